"""The import graph of marl_jax/, drawn from its source with `ast` (module-level imports and those
inside functions alike): no circle, and data/ imports nothing from eval/ or train/."""
import ast
import pathlib

import marl_jax

PACKAGE = pathlib.Path(marl_jax.__file__).resolve().parent


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


def test_the_config_imports_no_algorithm_module():
    """config.py builds and edits configs; the config check (config_check.py) reads the
    algorithms' rules, e.g. each estimator's record."""
    graph = import_graph()
    assert graph["marl_jax.config"] == set()
    assert "marl_jax.estimators" in graph["marl_jax.config_check"]
