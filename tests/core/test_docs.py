"""docs/hooks.md documents every hook in hookspecs.py with its exact signature (as datasette's
docs test does), so the page cannot drift from the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from acc_train import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS_MD = ROOT / "docs" / "hooks.md"

SPECS = {name: f for name, f in vars(hookspecs).items() if name.startswith("acc_train_") and callable(f)}


def signature_line(name: str) -> str:
    """``def NAME(arg: type, ...) -> type`` as written in hookspecs.py (annotations are strings there)."""
    sig = inspect.signature(SPECS[name])
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"def {name}({params}) -> {sig.return_annotation}"


def sections() -> dict[str, str]:
    """The page's ``## acc_train_...`` sections, by hook name."""
    parts = re.split(r"^## (acc_train_\w+)\s*$", HOOKS_MD.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_page_documents_exactly_the_hooks_in_hookspecs() -> None:
    assert sorted(sections()) == sorted(SPECS), "docs/hooks.md and hookspecs.py disagree on which hooks exist"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_hook_has_its_signature_when_return_and_an_example(name: str) -> None:
    section = sections().get(name)
    assert section is not None, f"docs/hooks.md has no section '## {name}'"
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"{name}: no python block"
    assert blocks[0].strip() == signature_line(name), f"{name}: the documented signature differs from hookspecs.py"
    assert "**Called**" in section and "**Return" in section, f"{name}: say when it is called and what its return means"
    firstresult = SPECS[name].acc_train_spec["firstresult"]
    assert ("*firstresult*" in section) == firstresult, f"{name}: firstresult is {firstresult}"
    examples = blocks[1:]
    assert examples, f"{name}: no example"
    for example in examples:
        assert f"def {name}(" in example, f"{name}: the example does not implement the hook"
        namespace: dict[str, object] = {}
        exec(compile(example, f"docs/hooks.md:{name}", "exec"), namespace)  # the example is valid Python
        impl = namespace[name]
        assert set(inspect.signature(impl).parameters) <= set(inspect.signature(SPECS[name]).parameters)
        assert getattr(impl, "acc_train_impl", None) is not None, f"{name}: the example lacks @hookimpl"
