#!/usr/bin/python3
"""Validates JSON documents against a JSON Schema (2020-12) file.

Usage: validate_schema.py SCHEMA DOCUMENT [DOCUMENT...]

A "$ref" to another schema resolves through the "$id" of every *.schema.json beside SCHEMA
(so "model-identity.schema.json" works from schemas/). Documents with duplicate keys are
rejected. Exit status: 0 all valid, 1 a document is invalid (each error is printed with its
JSON pointer), 2 bad usage, unreadable file or invalid schema.
"""
import json
import pathlib
import sys

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012


def load(path):
    def no_duplicates(pairs):
        obj = {}
        for key, value in pairs:
            if key in obj:
                raise ValueError(f"duplicate key {key!r}")
            obj[key] = value
        return obj

    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"), object_pairs_hook=no_duplicates)


def pointer(path):
    return "/" + "/".join(str(p) for p in path) if path else "(root)"


def main(argv):
    if len(argv) < 3 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    schema_path = pathlib.Path(argv[1]).resolve()
    try:
        schema = load(schema_path)
        # The sibling schemas by their $id (they $ref each other), in a referencing registry.
        resources = []
        for sibling in schema_path.parent.glob("*.schema.json"):
            s = load(sibling)
            resource = Resource.from_contents(s, default_specification=DRAFT202012)
            resources.append((s.get("$id", sibling.as_uri()), resource))
        if "$id" not in schema:
            resources.append((schema_path.as_uri(), Resource.from_contents(
                schema, default_specification=DRAFT202012)))
        registry = Registry().with_resources(resources)
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = cls(schema, registry=registry, format_checker=jsonschema.FormatChecker())
    except (OSError, ValueError, jsonschema.exceptions.SchemaError) as e:
        print(f"{schema_path}: cannot use schema: {e}", file=sys.stderr)
        return 2
    status = 0
    for doc_path in argv[2:]:
        try:
            doc = load(doc_path)
        except (OSError, ValueError) as e:
            print(f"{doc_path}: cannot read: {e}", file=sys.stderr)
            return 2
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        for e in errors:
            print(f"{doc_path}: {pointer(e.absolute_path)}: {e.message}", file=sys.stderr)
        if errors:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
