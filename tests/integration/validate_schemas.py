#!/usr/bin/python3
"""Validates documents against assay's JSON Schemas (2020-12).

    validate_schemas.py SCHEMA_DIR NAME=FILE [NAME=FILE ...]

NAME is a schema file name without ".schema.json" (an unknown NAME fails). Documents with
duplicate keys are rejected. Exits 1 naming the failures."""
import json
import os
import sys

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012


def no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError("duplicate key %r" % key)
        obj[key] = value
    return obj


def main():
    schema_dir = sys.argv[1]
    store = {}
    for name in os.listdir(schema_dir):
        if name.endswith(".schema.json"):
            with open(os.path.join(schema_dir, name)) as f:
                schema = json.load(f)
            store[name] = schema
            if "$id" in schema:
                store[schema["$id"]] = schema
    failed = 0
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        schema = store.get(name + ".schema.json")
        if schema is None:
            print("no schema %s.schema.json in %s (for %s)" % (name, schema_dir, path))
            failed += 1
            continue
        with open(path) as f:
            doc = json.load(f, object_pairs_hook=no_duplicates)
        registry = Registry().with_resources(
            (uri, Resource.from_contents(s, default_specification=DRAFT202012))
            for uri, s in store.items() if "://" in uri)
        validator = jsonschema.Draft202012Validator(schema, registry=registry)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        for e in errors[:5]:
            print("%s: %s at /%s" % (path, e.message, "/".join(str(p) for p in e.path)))
        failed += bool(errors)
        if not errors:
            print("%s: valid %s" % (path, name))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
