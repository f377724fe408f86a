"""Images from Dockerfiles: a parser and translator for the subset simple task images use.

A Dockerfile and its context are untrusted input (task authors write them), so a Dockerfile
becomes the same kind of build as an ``image.yaml`` (:mod:`ephemeral.sandbox.images`): one
mmdebstrap layer, then every step in the build sandbox (:mod:`ephemeral.sandbox.build_sandbox`:
root of its own user namespace, the image as ``/``, no network), never as host root.

What each instruction does here, with Docker's documented semantics:

- ``FROM debian:bookworm`` (``-slim``, ``debian:12*``) is our ``default`` image (Debian bookworm
  minbase with python3, the guest agent and user ``worker``); ``FROM NAME`` of one of our images
  (``sandbox_images/NAME``, or a name given by ``ephemeral images alias``) is that image.
  Multi-stage: ``COPY --from=STAGE`` copies out of an earlier stage (built in a sandbox of its
  own, then deleted); ``FROM`` an earlier stage is refused.
- ``RUN`` runs in the build sandbox as the current ``USER``, in ``WORKDIR``, with ``ENV`` and the
  stage's ``ARG`` values. The sandbox has no network: the packages of every ``apt-get install``
  (``apt install``) the translator reads in the ``RUN`` lines go into the image's mmdebstrap
  layer (fetched from the host's Debian mirror, as ``packages:`` are), and ``apt-get`` in the
  sandbox checks they are there (``update`` is a no-op, ``remove``/``purge`` are refused). The
  requirements of every ``pip install`` are fetched as wheels by the host's pip (as ``pip:``
  items are) into a directory the ``RUN`` sees, and pip in the sandbox installs from it
  (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``).
- ``COPY``/``ADD`` of context files (``--chown``, ``--chmod``; Docker's trailing-slash,
  directory-contents and glob rules; ``.dockerignore``); sources stay inside the context.
- ``ENV``, ``ARG`` (defaults, ``build_args``), ``WORKDIR`` (made), ``USER`` (the default user of a
  session's exec), ``SHELL``; ``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT`` are recorded.
- Anything else is a :class:`~ephemeral.errors.DockerfileError` naming the file, the line and the
  instruction: the builder never makes an image that lacks what the Dockerfile says.

The modules: :mod:`.parser` (Dockerfile and ``.dockerignore`` syntax), :mod:`.plan` (the
translator: instructions into our image plan), :mod:`.installs` (what ``RUN`` lines install),
:mod:`.context` (the build context and ``COPY`` sources), :mod:`.aliases` (which of our
images a name stands for) and :mod:`.builder` (the build, in the build sandbox).
"""

from ephemeral.sandbox.dockerfile.aliases import (
    DEBIAN_BASES,
    NAME,
    aliases,
    resolve_image,
    set_alias,
)
from ephemeral.sandbox.dockerfile.builder import (
    COPY_TIMEOUT_S,
    MAX_DOCKERFILE_BYTES,
    PIP_TIMEOUT_S,
    RUN_TIMEOUT_S,
    WHEELS,
    abuild_dockerfile,
    build_dockerfile,
    load,
    read_in_image,
)
from ephemeral.sandbox.dockerfile.context import (
    MAX_CONTEXT_BYTES,
    MAX_CONTEXT_FILES,
    Context,
    resolve_copy,
    scan_context,
)
from ephemeral.sandbox.dockerfile.installs import requirements_file
from ephemeral.sandbox.dockerfile.parser import (
    IgnoreRule,
    Instruction,
    Parsed,
    exec_form,
    expand,
    fail,
    ignored,
    parse,
    parse_dockerignore,
    split_flags,
    split_words,
)
from ephemeral.sandbox.dockerfile.plan import (
    DEFAULT_PATH,
    DEFAULT_SHELL,
    TRANSLATOR_VERSION,
    CopyStep,
    Plan,
    RunStep,
    Step,
    WorkdirStep,
    translate,
)

__all__ = [
    "COPY_TIMEOUT_S",
    "DEBIAN_BASES",
    "DEFAULT_PATH",
    "DEFAULT_SHELL",
    "MAX_CONTEXT_BYTES",
    "MAX_CONTEXT_FILES",
    "MAX_DOCKERFILE_BYTES",
    "NAME",
    "PIP_TIMEOUT_S",
    "RUN_TIMEOUT_S",
    "TRANSLATOR_VERSION",
    "WHEELS",
    "Context",
    "CopyStep",
    "IgnoreRule",
    "Instruction",
    "Parsed",
    "Plan",
    "RunStep",
    "Step",
    "WorkdirStep",
    "abuild_dockerfile",
    "aliases",
    "build_dockerfile",
    "exec_form",
    "expand",
    "fail",
    "ignored",
    "load",
    "parse",
    "parse_dockerignore",
    "read_in_image",
    "requirements_file",
    "resolve_copy",
    "resolve_image",
    "scan_context",
    "set_alias",
    "split_flags",
    "split_words",
    "translate",
]
