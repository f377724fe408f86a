"""Templates are bounded (issue 18): each operator, method and filter that can build a large
string or number, loops, concatenation in loops and output through macros is refused with a
recipe error naming the field, and the render never held much more than the field's limit.

Memory is measured with tracemalloc around the load (which test-renders every template): each
case asks for at least 10 million characters, the limit is 100,000 (16,384 for commands)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from ephemeral.recipes.recipe import expand, load_recipe
from tests.recipes.helpers import only, recipe_errors, write

BIG = 10_000_000
PEAK_BYTES = 8 << 20  # a few copies of the 100,000-character limit, and the loader itself

SET_BIG = "{% set big = 'a' * 40000 %}"
BUILDERS = {
    "repeat": f"{{{{ 'a' * {BIG} }}}}",
    "percent width": f"{{{{ '%{BIG}s' % 'a' }}}}",
    "percent star": "{{ '%*s' % (10000000, 'a') }}",
    "format filter": f"{{{{ '%{BIG}d'|format(1) }}}}",
    "str.format width": f"{{{{ '{{:>{BIG}}}'.format('a') }}}}",
    "str.format_map": f"{{{{ '{{a:>{BIG}}}'.format_map({{'a': 1}}) }}}}",
    "center method": f"{{{{ 'a'.center({BIG}) }}}}",
    "ljust": f"{{{{ 'a'.ljust({BIG}) }}}}",
    "rjust": f"{{{{ 'a'.rjust({BIG}) }}}}",
    "zfill": f"{{{{ '1'.zfill({BIG}) }}}}",
    "center filter": f"{{{{ 'a'|center({BIG}) }}}}",
    "indent width": f"{{{{ 'a'|indent({BIG}) }}}}",
    "indent lines": "{{ ('a\\n' * 40000)|indent(300) }}",
    "wordwrap": "{{ ('a' * 90000)|wordwrap(1) }}",
    "wordwrap string": f"{SET_BIG}{{{{ 'a b c d'|wordwrap(1, wrapstring=big) }}}}",
    "join filter": f"{SET_BIG}{{{{ [big, big, big]|join }}}}",
    "join method": f"{SET_BIG}{{{{ big.join([big, big, big]) }}}}",
    "join of a map": "{{ range(90000)|map('string')|join('-----') }}",
    "replace filter": f"{SET_BIG}{{{{ big|replace('a', 'aaaaa') }}}}",
    "replace method": f"{SET_BIG}{{{{ big.replace('', 'bb') }}}}",
    "truncate end": f"{SET_BIG}{{{{ 'abc'|truncate(1, end=big ~ big ~ 'x' * 30000) }}}}",
    "batch": f"{{{{ [1]|batch({BIG}, 'x')|list }}}}",
    "slice": f"{{{{ [1]|slice({BIG}) }}}}",
    "urlize target": f"{SET_BIG}{{{{ ('a.io ' * 5000)|urlize(target=big) }}}}",
    "sum of lists": "{{ [[1], [2]]|sum(start=[]) }}",
    "plus": f"{SET_BIG}{{{{ big + big + big }}}}",
    "concat": f"{SET_BIG}{{{{ big ~ big ~ big }}}}",
    "concat in a loop": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    "list repeat": "{{ ['a' * 1000] * 100000 }}",
    "power": "{{ (10 ** 64) ** 4096 }}",
    "squaring": "{% set x = 10 ** 60 %}" + "{% set x = x * x %}" * 12 + "{{ x }}",
    "output in a loop": "{% for i in range(100000) %}{{ 'a' * 90000 }}{% endfor %}",
    "text in a loop": "{% for i in range(100000) %}" + "a" * 1000 + "{% endfor %}",
    "macro output": (
        "{% macro m() %}{% for i in range(99) %}{{ 'a' * 99999 }}{% endfor %}{% endmacro %}"
        "{{ m()|length }}"
    ),
    "nested loops": "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}",
    "recursive macro": "{% macro m(n) %}{{ m(n) ~ m(n) }}{% endmacro %}{{ m(1) }}",
    "expandtabs": "{{ '\\t'.expandtabs(10000000) }}",
    "encode": "{{ 'a'.encode().center(10000000) }}",
    "lipsum": f"{{{{ lipsum({BIG}) }}}}",
    "to_bytes": f"{{{{ (1).to_bytes({BIG}, 'big') }}}}",
}


@pytest.mark.parametrize("template", BUILDERS.values(), ids=BUILDERS.keys())
def test_each_builder_is_a_clear_error_in_bounded_memory(tmp_path: Path, template: str) -> None:
    path = write(tmp_path, f"name: bounds\nmodel: x/y\nprompt: {json.dumps('hi ' + template)}\n")
    tracemalloc.start()
    try:
        errors = recipe_errors(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = only(errors, "prompt")
    assert err["message"].startswith("template: "), err
    assert any(
        phrase in err["message"]
        for phrase in (
            "more than",  # would build / builds / renders to more than N characters, steps, digits
            "not available in recipe templates",
            "is undefined",  # lipsum is not offered
            "only numbers can be summed",
            "not allowed",
            "recursion",
            "took longer than",  # the deadline, when a loaded host is slower than the step cap
        )
    ), err
    assert peak < PEAK_BYTES, f"peak {peak} bytes"


def test_a_command_template_is_bounded_by_the_command_limit(tmp_path: Path) -> None:
    text = "name: bounds\nmodel: x/y\nprompt: hi\nverify: [\"echo {{ 'a' * 20000 }}\"]\n"
    err = only(recipe_errors(write(tmp_path, text)), "verify[0]")
    assert "more than 16384 characters" in err["message"], err


def test_ordinary_templates_still_render(tmp_path: Path) -> None:
    prompt = (
        "{% set items = ['a', 'b'] %}{{ items|join(', ') }} {{ 'x'|center(5) }}|"
        "{{ '%s-%03d' % ('n', 7) }} {{ '{}:{}'.format(1, 2) }} "
        "{{ ('hello world ' * 3)|wordwrap(12)|length }} "
        "{% for i in range(3) %}{{ loop.index }}{% endfor %} {{ 'ab' ~ 2 * 3 }} "
        "{{ 'a b'.split()|list }} {{ {'k': 1}.items()|list }} {{ 2 ** 10 }} {{ 'Hi'|lower }}"
    )
    [run] = expand(
        load_recipe(write(tmp_path, f"name: ok\nmodel: x/y\nprompt: {json.dumps(prompt)}\n")),
        default_model="u/m",
    )
    assert run.prompt == ("a, b   x  |n-007 1:2 35 123 ab6 ['a', 'b'] [('k', 1)] 1024 hi")
