"""Import circles among the modules of kvpool and workers (strongly connected components of the import graph,
TYPE_CHECKING imports included, as import-linter counts them), and the longest chain of imports.

    PYTHONPATH=<checkout> python evidence/layout/cycles.py
"""

from __future__ import annotations

import functools
import sys

import grimp


def main() -> int:
    graph = grimp.build_graph("kvpool", "workers")
    modules = sorted(graph.modules)
    imports = {module: sorted(graph.find_modules_directly_imported_by(module)) for module in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in imports[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    print(f"{len(modules)} modules, {sum(map(len, imports.values()))} imports, {len(circles)} import circles")
    for circle in circles:
        print("  circle:", " <-> ".join(circle))
    if not circles:
        @functools.cache
        def depth(module: str) -> int:
            return 1 + max((depth(imported) for imported in imports[module]), default=0)

        print("longest chain of imports:", max(depth(module) for module in modules), "levels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
