"""The documentation a user reads: every relative link resolves inside the repository, and no
file refers to files a user of the project does not have."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKDOWN = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(p for folder in ("kernels", "reference", "bench", "examples", "tests", ".ci")
                 for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", "")
                 and p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve_inside_the_repository(path):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    for link in links:
        assert not link.startswith(("http:", "https:")), f"{path.name}: external link {link}"
        target = (path.parent / link).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), f"{path.name}: {link}"


def test_docs_cover_the_design_and_a_kernel_authors_guide():
    assert {"design.md", "kernel-guide.md", "usage.md"} <= {p.name for p in MARKDOWN}
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/design.md", "docs/kernel-guide.md", "docs/usage.md"):
        assert f"]({page})" in readme


def test_nothing_refers_to_files_outside_the_repository():
    # The project's internal contract lives outside the repository; users never see it.
    outside = re.compile(r"DESIGN\.md|shared folder|\.\./shared|/work/")
    offenders = [str(p.relative_to(ROOT)) for p in [*MARKDOWN, *SOURCES]
                 if p != pathlib.Path(__file__).resolve() and outside.search(p.read_text())]
    assert not offenders


# Fenced blocks the suite runs as written: (page, the heading they follow).
RUN_AS_WRITTEN = [(ROOT / "README.md", "## Quickstart"),
                  (ROOT / "docs" / "kernel-guide.md", "## 0. A first kernel")]

# Pages that quote the code (a user's examples in usage.md and the README are their own code).
QUOTING = [ROOT / "CONTRIBUTING.md", ROOT / "docs" / "design.md", ROOT / "docs" / "kernel-guide.md"]


def _signatures_in_code() -> dict[str, list[ast.arguments]]:
    """Every function the wheel, bench and examples define, nested ones included, by name."""
    found: dict[str, list[ast.arguments]] = {}
    for folder in ("kernels", "reference", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef):
                    found.setdefault(node.name, []).append(node.args)
    return found


def _quoted(path: pathlib.Path) -> list[tuple[str, str, bool]]:
    """(name, parameters, fenced) of each signature a page quotes: the `def`s of its fenced
    blocks, and inline spans `name(...)` whose parameters parse as a signature's. A block the
    suite runs as written (`RUN_AS_WRITTEN`) is its own code, not a quote."""
    text = path.read_text()
    for page, heading in RUN_AS_WRITTEN:
        if page == path:
            text = text.replace(_python_block(page, heading), "")
    quotes = [(name, params, True) for block in re.findall(r"```\w*\n(.*?)```", text, re.S)
              for name, params in re.findall(r"^\s*def (\w+)\((.*?)\)", block, re.M | re.S)]
    return quotes + [(name, params, False)
                     for name, params in re.findall(r"`(\w+)\(([^()`]*)\)`", text)]


def _accepts(code: ast.arguments, quoted: ast.arguments) -> bool:
    """Whether a quoted signature (or call) names the code's parameters: its plain parameters
    are the code's leading positional ones in order (`self` aside; a `*rest` stands for the
    others), and each one with a default or after `*` is a parameter of the code."""
    positional = [a.arg for a in code.posonlyargs + code.args if a.arg != "self"]
    names = {*positional, *(a.arg for a in code.kwonlyargs)}
    names |= {a.arg for a in (code.vararg, code.kwarg) if a is not None}
    plain = quoted.args[:len(quoted.args) - len(quoted.defaults)]
    plain_names = [a.arg for a in plain if a.arg != "self"]
    if plain_names != positional[:len(plain_names)]:
        return False
    keywords = quoted.args[len(plain):] + quoted.kwonlyargs
    return all(a.arg in names for a in keywords)


@pytest.mark.parametrize("path", QUOTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_signatures_exist_in_the_code(path):
    code = _signatures_in_code()
    stale = []
    for name, params, fenced in _quoted(path):
        try:
            quoted = ast.parse(f"def {name}({params}): pass").body[0].args
        except SyntaxError:
            continue  # a call with expressions or an ellipsis, not a signature
        if name not in code:
            if fenced:
                stale.append(f"def {name}({params}): no such function")
            continue
        if not any(_accepts(candidate, quoted) for candidate in code[name]):
            stale.append(f"{name}({params})")
    assert not stale, f"{path.name} quotes signatures the code no longer has: {stale}"


def test_every_list_of_implementations_names_each_registered_one():
    """The texts that list what `implementation=` takes, or which kernels exist, name every
    registry entry: the package docstring, the example's usage and --help, the distribution's
    description, CONTRIBUTING's list of implementation subpackages."""
    import tomllib

    import kernels
    from kernels import registry

    names = set(registry.names())
    quoted = re.search(r"implementation=None` \(([^)]*)\)", " ".join(kernels.__doc__.split()))
    assert set(re.findall(r'"(\w+)"', quoted.group(1))) == names
    digits = (ROOT / "examples" / "train_digits.py").read_text()
    assert set(re.search(r"--implementation ([\w|]+)", digits).group(1).split("|")) == names
    help_text = " ".join(re.search(r'"--implementation".*?help=(.*?)\)', digits, re.S).group(1)
                         .split())
    assert all(re.search(rf"\b{name}\b", help_text) for name in names), help_text
    # Each kernel's backend as the description names it (a new entry adds its name here).
    shown = {"triton": "Triton", "mosaic": "Mosaic", "mosaic_gpu": "Mosaic GPU"}
    assert set(shown) == set(registry.kernel_names())
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert all(text in description for text in shown.values()), description
    today = re.search(r"\(today ([^)]*)\)", (ROOT / "CONTRIBUTING.md").read_text()).group(1)
    assert {registry.get(name).subpackage + "/" for name in registry.kernel_names()} == set(
        re.findall(r"`(\w+/)`", today))


def _python_block(path: pathlib.Path, heading: str) -> str:
    """The first ```python block after `heading` in `path`."""
    text = path.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def test_the_guides_first_kernel_runs_as_written_and_lowers_for_a_tpu():
    """Section 0 of the kernel guide, run unchanged (it checks itself against the reference);
    the same `pl.pallas_call`, compiled rather than interpreted, lowers to a Mosaic kernel."""
    import jax.numpy as jnp

    from kernels._pallas import MOSAIC_CALL_MARKER, lowered_text

    namespace: dict = {}
    exec(_python_block(*RUN_AS_WRITTEN[1]), namespace)
    x, scale = jnp.ones((20, 256), jnp.float32), jnp.ones((256,), jnp.float32)
    assert MOSAIC_CALL_MARKER in lowered_text(namespace["rms_norm"], x, scale, platform="tpu")


def test_the_readme_quickstart_runs_as_written():
    page, heading = RUN_AS_WRITTEN[0]
    exec(_python_block(page, heading), {})


def test_the_readme_defaults_table_is_kernels_defaults():
    """Each cell of the README's table of what `implementation=None` runs names what
    `kernels.defaults.default` picks there, per dtype where the cell splits by dtype."""
    from kernels import defaults

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| op | H100 | other GPUs | TPU | CPU | why |"):].split("\n\n")[0]
    where = {"H100": ("cuda", "NVIDIA H100 80GB HBM3"), "other GPUs": ("cuda", "NVIDIA A100"),
             "TPU": ("tpu", "TPU v5 lite"), "CPU": ("cpu", "cpu")}
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert {op for row in rows for op in re.findall(r"`(\w+)`", row[0])} == {
        "matmul", "conv2d", "normalize", "layer_norm", "rms_norm", "gather"}
    for row in rows:
        for op in re.findall(r"`(\w+)`", row[0]):
            for (column, (backend, kind)), cell in zip(where.items(), row[1:5]):
                split = re.fullmatch(r"bfloat16: (.*); else (.*)", cell)
                for dtype, names in ((("bfloat16", split[1]), ("float32", split[2])) if split
                                     else (("bfloat16", cell), ("float32", cell))):
                    assert tuple(re.findall(r"`(\w+)`", names)) == defaults.default(
                        op, backend, dtype, kind), (op, column, dtype)
