#!/usr/bin/env python3
"""schemas/openapi.yaml against assayd's route table (supervisor/api/routes.cpp): the same
(path, method) pairs, each operation with a success answer, every $ref to a schema file resolving
to a file in schemas/. Exit 1 naming each difference."""
import pathlib
import re
import sys

import yaml

ROUTE = re.compile(r'\{\{((?:"[^"]*"\s*,?\s*)+)\},\s*"([A-Z]+)"')


def route_table(routes_cpp: str) -> set[tuple[str, str]]:
    table = routes_cpp[routes_cpp.index("static const std::vector<Route> table"):]
    table = table[:table.index("return table;")]
    pairs = set()
    for segments, method in ROUTE.findall(table):
        parts = ["{id}" if s == "*" else s for s in re.findall(r'"([^"]*)"', segments)]
        pairs.add(("/" + "/".join(parts), method.lower()))
    return pairs


def described(spec: dict) -> set[tuple[str, str]]:
    methods = {"get", "post", "put", "delete", "patch", "head", "options"}
    return {(p, m) for p, item in spec["paths"].items() for m in item if m in methods}


def file_refs(node, out: list[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            out.append(ref)
        for v in node.values():
            file_refs(v, out)
    elif isinstance(node, list):
        for v in node:
            file_refs(v, out)


ANY_ROUTE = ("400", "413", "414", "431", "503")


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    spec_path = root / "schemas" / "openapi.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    errors = []
    if not str(spec.get("openapi", "")).startswith("3.1"):
        errors.append(f"{spec_path}: openapi is {spec.get('openapi')!r}, not 3.1.x")
    routes = route_table((root / "supervisor" / "api" / "routes.cpp").read_text())
    if len(routes) < 10:
        errors.append(f"only {len(routes)} routes parsed from routes.cpp: the parser is stale")
    ops = described(spec)
    for p, m in sorted(routes - ops):
        errors.append(f"route {m.upper()} {p} is in routes.cpp but not in openapi.yaml")
    for p, m in sorted(ops - routes):
        errors.append(f"operation {m.upper()} {p} is in openapi.yaml but not in routes.cpp")
    for p, item in spec["paths"].items():
        for m, op in item.items():
            if m == "parameters":
                continue
            codes = [str(c) for c in op.get("responses", {})]
            if not any(c.startswith("2") for c in codes):
                errors.append(f"{m.upper()} {p} describes no success status")
            # What the connection layer answers on any route, before the route runs: a bad
            # request line, a body, target or header over its limit, a connection or stream
            # limit (supervisor/api/answer.cpp; found by schemathesis as an undocumented 414).
            for c in ANY_ROUTE:
                if c not in codes:
                    errors.append(f"{m.upper()} {p} does not describe {c}, which any route answers")
    refs: list[str] = []
    file_refs(spec, refs)
    for ref in sorted(set(refs)):
        if not (spec_path.parent / ref.split("#")[0]).is_file():
            errors.append(f"$ref {ref} names no file in schemas/")
    for e in errors:
        print(e)
    print(f"{len(routes)} routes, {len(ops)} operations, {len(set(refs))} schema files referenced")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
