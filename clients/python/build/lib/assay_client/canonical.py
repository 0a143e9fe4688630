"""The two canonical JSON forms assay's records are hashed in.

``canonical`` is RFC 8785 (JCS), the form assayd writes ``result.json`` in and hashes
``result_sha256`` over (common/json.h ``canonical``): keys sorted by UTF-16 code units, no
whitespace, numbers as ECMAScript prints them, strings with minimal escaping and raw UTF-8.

``python_canonical`` is Kiln's: ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)`` (common/json.h ``python_canonical``).
"""
import decimal
import hashlib
import json

__all__ = ["canonical", "python_canonical", "sha256_id", "es_number"]


def es_number(x: float) -> str:
    """ECMAScript's Number.prototype.toString of a finite double (RFC 8785 section 3.2.2.3)."""
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{x!r} has no canonical JSON form")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    # repr gives the shortest digits that round-trip; only their layout differs from JS.
    t = decimal.Decimal(repr(abs(x))).as_tuple()
    digits = "".join(map(str, t.digits)).rstrip("0") or "0"
    n = len("".join(map(str, t.digits))) + t.exponent  # value = 0.DIGITS x 10^n
    k = len(digits)
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return sign + mantissa + "e" + ("+" if e > 0 else "-") + str(abs(e))


def _string(s: str) -> str:
    # JCS escapes only '"', '\\' and the control characters (as \b \t \n \f \r or \u00XX).
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif o < 0x20:
            out.append({8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"}.get(o, "\\u%04x" % o))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def canonical(value) -> str:
    """RFC 8785 canonical form of a JSON value (dict, list, str, int, float, bool, None)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return es_number(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        return "{" + ",".join(_string(k) + ":" + canonical(value[k]) for k in keys) + "}"
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def python_canonical(value) -> str:
    """Kiln's canonical form."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def sha256_id(data) -> str:
    """``sha256:<64 lowercase hex>`` of bytes (a str is taken as UTF-8)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return "sha256:" + hashlib.sha256(data).hexdigest()
