#!/usr/bin/env python3
"""The bundled OpenAPI document (scripts/bundle-openapi, shipped as share/assay/openapi.json)
stands alone: every $ref is a pointer into the document and resolves there, no embedded schema
keeps an $id that would move a base, openapi-spec-validator finds it valid, and the embedded
schemas still mean what the files do: a real result and request validate against their
components, and a changed one does not.

Usage: check_openapi_bundle.py SOURCE_DIR. Exit 0 when every check holds."""
import copy
import json
import pathlib
import subprocess
import sys
import tempfile

failed = []


def check(name, ok, got=None):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {got!r}"), flush=True)
    if not ok:
        failed.append(name)


def refs(node, out):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out.append(v)
            else:
                refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def resolve(doc, ref):
    node = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def main(root):
    root = pathlib.Path(root)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "openapi.json"
        subprocess.run([sys.executable, str(root / "scripts/bundle-openapi"), str(out)], check=True)
        doc = json.loads(out.read_text())
    all_refs = []
    refs(doc, all_refs)
    outside = [r for r in all_refs if not r.startswith("#/")]
    check(f"all {len(all_refs)} $refs point into the document", not outside, outside[:5])
    broken = []
    for r in set(all_refs) - set(outside):
        try:
            resolve(doc, r)
        except (KeyError, IndexError, ValueError, TypeError):
            broken.append(r)
    check("every $ref resolves in it", not broken, sorted(broken)[:5])
    ids = [n for n, s in doc["components"]["schemas"].items() if isinstance(s, dict) and "$id" in s]
    check("no embedded schema keeps an $id", not ids, ids)

    from openapi_spec_validator import validate
    try:
        validate(doc)
        check("openapi-spec-validator: valid", True)
    except Exception as e:  # noqa: BLE001 - its errors are many types; the message is the point
        check("openapi-spec-validator: valid", False, str(e)[:500])

    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    files = {p.name: json.loads(p.read_text()) for p in (root / "schemas").glob("*.schema.json")}
    registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s, default_specification=DRAFT202012))
        for s in files.values() if "$id" in s)

    def findings(validator, instance):
        return sorted((e.json_path, e.message) for e in validator.iter_errors(instance))

    def same_meaning(component, file_name, instance):
        """The bundled component and the schema file (through the $id registry, as
        tests/tools/validate_schema.py resolves it) find exactly the same errors."""
        bundled = copy.deepcopy(doc)
        bundled["$ref"] = "#/components/schemas/" + component
        a = findings(Draft202012Validator(bundled), instance)
        b = findings(Draft202012Validator(files[file_name], registry=registry), instance)
        return a == b, a

    result = json.loads((root / "tests/client/fixtures/report/result.json").read_text())
    request = json.loads((root / "tests/client/fixtures/kiln-request-v1.json").read_text())
    wrong_type = copy.deepcopy(result)
    wrong_type["verdict"]["argmax_candidate"] = 7
    behind_ref = copy.deepcopy(result)  # reached through process-containment's own file
    behind_ref["oracle"]["process"]["mode"] = 7
    identity = copy.deepcopy(result)  # reached through model-identity's file
    identity["model_identity"]["weight_files"] = "none"
    for name, component, file_name, instance, want_errors in (
            ("a real result", "next-token-oracle-result", "next-token-oracle-result.schema.json",
             result, None),
            ("a result with a wrong type", "next-token-oracle-result",
             "next-token-oracle-result.schema.json", wrong_type, True),
            ("a wrong field behind a cross-file $ref", "next-token-oracle-result",
             "next-token-oracle-result.schema.json", behind_ref, True),
            ("a wrong model identity", "next-token-oracle-result",
             "next-token-oracle-result.schema.json", identity, True),
            ("Kiln's real request", "kiln-next-token-request", "kiln-next-token-request.schema.json",
             request, False)):
        same, errors = same_meaning(component, file_name, instance)
        check(f"{name}: the bundle finds what the schema files find ({len(errors)} errors)", same)
        if want_errors is not None:
            check(f"{name}: " + ("refused" if want_errors else "valid"), bool(errors) == want_errors,
                  errors[:3])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
