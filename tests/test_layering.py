"""The import graph of marl_jax/, drawn from its source with `ast` (module-level imports and those
inside functions alike): no circle, data/ imports nothing from eval/ or train/, train/ nothing
from eval/ or the credit probe (marl_jax/credit, which only the pipeline imports), and no module
of marl_jax/, configs/ or experiments/ imports a private module of a dependency."""
import ast
import json
import pathlib

import pytest

import marl_jax

PACKAGE = pathlib.Path(marl_jax.__file__).resolve().parent
ROOT = PACKAGE.parent
# Internals that change without notice between the releases setup.cfg admits.
PRIVATE_MODULES = ("jax._src", "transformers.integrations")


def _module_name(path: pathlib.Path) -> str:
    parts = ("marl_jax",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of marl_jax -> the marl_jax modules it imports anywhere in its source."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                # `from package import module` imports the module; `from module import name`
                # the module itself.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]
            else:
                continue
            targets |= {n for n in names if n in modules and n != name}
        graph[name] = targets
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_drawing_finds_a_planted_circle_and_the_package_has_none():
    graph = import_graph()
    assert "marl_jax.data.tasks" in graph["marl_jax.pipeline"], "the drawing sees real imports"
    planted = {k: set(v) for k, v in graph.items()}
    planted["marl_jax.losses"].add("marl_jax.pipeline")
    assert find_cycle(planted) is not None
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_data_imports_nothing_from_eval_or_train():
    arrows = [(source, target) for source, targets in import_graph().items()
              if source.startswith("marl_jax.data") for target in targets
              if target.startswith(("marl_jax.eval", "marl_jax.train"))]
    assert arrows == []


def test_train_imports_nothing_from_eval_or_the_credit_probe():
    """The PPO loop is handed the advantage-quality probe by the pipeline, as it is handed the
    metrics writer: train/ imports no module above it."""
    arrows = [(source, target) for source, targets in import_graph().items()
              if source.startswith("marl_jax.train") for target in targets
              if target.startswith(("marl_jax.eval", "marl_jax.credit"))]
    assert arrows == []


def test_the_credit_package_sits_above_train_and_eval_and_below_the_pipeline():
    """marl_jax.credit imports the engine, train/ and eval/; the pipeline (and what runs it)
    imports marl_jax.credit, nothing else does, and it imports none of them."""
    graph = import_graph()
    above = {"marl_jax.pipeline", "marl_jax.experiment", "marl_jax.stages"}
    credit = {name for name in graph if name.startswith("marl_jax.credit")}
    importers = {source for source, targets in graph.items() if targets & credit} - credit
    assert importers == {"marl_jax.pipeline"}
    assert not {target for source in credit for target in graph[source]} & above
    assert {"marl_jax.train.ppo_types", "marl_jax.rollout.turns"} <= set().union(
        *(graph[source] for source in credit))


def test_the_config_imports_no_algorithm_module():
    """config.py builds and edits configs; the config check (config_check.py) reads the
    algorithms' rules, e.g. each estimator's record."""
    graph = import_graph()
    assert graph["marl_jax.config"] == set()
    assert "marl_jax.estimators" in graph["marl_jax.config_check"]


def private_imports(source: str, filename: str) -> list[str]:
    """`file:line: module` for each import of a PRIVATE_MODULES module in `source`: `import`,
    `from ... import` (of a module or of a name) and `importlib.import_module` / `__import__`
    of a constant name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{filename}:{node.lineno}: {name}" for name in names
                  if any(name == p or name.startswith(p + ".") for p in PRIVATE_MODULES)]
    return found


def _sources():
    for folder in ("marl_jax", "configs", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()
        for path in sorted((ROOT / folder).rglob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
            # Shell and magic lines (`!pip ...`, `%cd`) are not Python.
            yield str(path.relative_to(ROOT)), "\n".join(
                "" if line.lstrip().startswith(("!", "%")) else line for line in code.splitlines())


@pytest.mark.smoke
def test_no_private_module_of_a_dependency_is_imported():
    planted = """
import jax._src.hardware_utils
from jax._src import traceback_util
from jax import _src
from transformers.integrations.gguf import convert_gguf_tokenizer
import importlib
importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
__import__("jax._src.config")
import jax.extend.random, transformers.utils.logging
"""
    assert [line.split(": ", 1)[1] for line in private_imports(planted, "planted.py")] == [
        "jax._src.hardware_utils", "jax._src", "jax._src.traceback_util", "jax._src",
        "transformers.integrations.gguf", "transformers.integrations.gguf.convert_gguf_tokenizer",
        "transformers.integrations.gguf.gguf_tokenizer_mapping", "jax._src.config"]
    sources = dict(_sources())
    assert {"marl_jax/models/tokenizer.py", "experiments/run.py", "marl_jax/distributed.py",
            "experiments/colab_tpu_demo.ipynb"} <= set(sources)
    assert [hit for name, source in sources.items() for hit in private_imports(source, name)] == []
