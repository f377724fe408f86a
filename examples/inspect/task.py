"""An offline Inspect AI task in Ephemeral sandboxes.

    inspect eval examples/inspect/task.py --sandbox ephemeral
    ephemeral costs --by kind          # the sessions it ran, next to runs

The model is Inspect's ``mockllm`` driven by a script (no network, no key): for each sample it
calls the ``bash()`` tool once with the sample's command, then answers. The scorer runs inside
the sample's sandbox and checks the file the command wrote, so the verdict comes from the
sandbox, not from what the model said.
"""

from __future__ import annotations

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import (
    ChatMessage,
    ChatMessageTool,
    GenerateConfig,
    ModelOutput,
    ModelUsage,
    get_model,
)
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import ToolChoice, ToolInfo, bash
from inspect_ai.util import sandbox

# Registers the provider even before the package's entry point is installed (pip install -e .).
import ephemeral.inspect_provider  # noqa: F401

SAMPLES = [
    Sample(id="hello", input="Write hello to answer.txt", target="hello",
           metadata={"command": "echo hello > answer.txt"}),
    Sample(id="whoami", input="Write your user name to answer.txt", target="worker",
           metadata={"command": "whoami > answer.txt"}),
    Sample(id="sum", input="Write 40 + 2 to answer.txt", target="42",
           metadata={"command": "python3 -c 'print(40 + 2)' > answer.txt"}),
]  # fmt: skip
COMMANDS = {s.input: s.metadata["command"] for s in SAMPLES if s.metadata}


def scripted(
    messages: list[ChatMessage],
    tools: list[ToolInfo],
    tool_choice: ToolChoice,
    config: GenerateConfig,
) -> ModelOutput:
    """First turn: one bash call with the sample's command; after the tool result: done."""
    if any(isinstance(m, ChatMessageTool) for m in messages):
        output = ModelOutput.from_content(model="mockllm", content="Done: see answer.txt.")
    else:
        prompt = next(m.text for m in messages if m.role == "user")
        output = ModelOutput.for_tool_call(
            model="mockllm", tool_name="bash", tool_arguments={"command": COMMANDS[prompt]}
        )
    # Usage given, so mockllm does not count tokens with tiktoken (which downloads its tables).
    output.usage = ModelUsage(input_tokens=50, output_tokens=10, total_tokens=60)
    return output


@scorer(metrics=[accuracy()])
def file_in_sandbox():
    async def score(state: TaskState, target: Target) -> Score:
        result = await sandbox().exec(["cat", "answer.txt"])
        got = result.stdout.strip()
        return Score(value=CORRECT if got == target.text else INCORRECT, answer=got)

    return score


@task
def sandboxed_answers() -> Task:
    return Task(
        dataset=SAMPLES,
        solver=[use_tools(bash(timeout=30)), generate()],
        scorer=file_in_sandbox(),
        model=get_model("mockllm/model", custom_outputs=scripted),
        sandbox="ephemeral",
    )
