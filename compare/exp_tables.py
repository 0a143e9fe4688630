#!/usr/bin/env python3
"""Prints the constants of the KL kernel's exp (compare/kernel.cpp), so they can be checked.

kExp2Scale[j]: the double nearest to 2^(j/16), as bits, less j << 48: adding k << 48 (k = 16 m + j)
to these bits adds m to the exponent and cancels the j, giving 2^m * (the double nearest 2^(j/16)).
kExp2Tail[j]: (2^(j/16) - hi) / hi rounded, hi being that double: hi * (1 + tail) is 2^(j/16) to
within about 2^-106 relative.
kExpPoly: q(r) = c0 + c1 r + c2 r^2 + c3 r^3 + c4 r^4, the minimax approximation (Remez, 50
digits) of (exp(r) - 1 - r) / r^2 on |r| <= ln2/32: exp(r) = 1 + r + r^2 q(r) to 2.9e-17 relative.
Needs mpmath (python3-mpmath).
"""
import struct
import mpmath as mp

mp.mp.dps = 50


def bits(d):
    return struct.unpack("<Q", struct.pack("<d", d))[0]


def double(b):
    return struct.unpack("<d", struct.pack("<Q", b & (2**64 - 1)))[0]


scale, tail = [], []
for j in range(16):
    exact = mp.mpf(2) ** (mp.mpf(j) / 16)
    hi = float(exact)  # mpmath rounds to nearest
    scale.append(double(bits(hi) - (j << 48)))
    tail.append(float((exact - mp.mpf(hi)) / mp.mpf(hi)))

a = mp.log(2) / 32 * (1 + mp.mpf("1e-6"))


def g(r):
    return mp.mpf(1) / 2 if r == 0 else (mp.exp(r) - 1 - r) / r**2


n = 5
pts = sorted(a * mp.cos(mp.pi * i / n) for i in range(n + 1))
for _ in range(40):  # Remez exchange
    A = mp.matrix(n + 1, n + 1)
    b = mp.matrix(n + 1, 1)
    for i, x in enumerate(pts):
        for k in range(n):
            A[i, k] = x**k
        A[i, n] = (-1) ** i
        b[i] = g(x)
    sol = mp.lu_solve(A, b)
    c = [sol[k] for k in range(n)]
    grid = [-a + 2 * a * i / 4000 for i in range(4001)]
    err = [sum(c[k] * x**k for k in range(n)) - g(x) for x in grid]
    ext = [grid[i] for i in range(len(grid))
           if (i == 0 or abs(err[i]) >= abs(err[i - 1])) and (i == len(grid) - 1 or abs(err[i]) >= abs(err[i + 1]))]
    if len(ext) != n + 1:
        break
    if max(abs(p - q) for p, q in zip(ext, pts)) < a * mp.mpf("1e-12"):
        break
    pts = ext
coef = [float(x) for x in c]
worst = max(abs((1 + x + x * x * sum(mp.mpf(coef[k]) * x**k for k in range(n))) / mp.exp(x) - 1)
            for x in [-a + 2 * a * i / 20000 for i in range(20001)])

print("kExp2Scale", [x.hex() for x in scale])
print("kExp2Tail", [x.hex() for x in tail])
print("kExpPoly", [x.hex() for x in coef])
print("worst relative error of 1 + r + r^2 q(r):", mp.nstr(worst, 3))
