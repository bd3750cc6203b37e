"""The sequences of the association benchmarks (:mod:`.synthetic`), generated on the fly from a numpy random
generator: every generator returns ``(input_ids, targets)``, with :data:`IGNORE` at every position that is not
scored.

* **MQAR** (Zoology, Arora et al. 2023; Based, Arora et al. ICML 2024): a sequence opens with P
  key-value pairs ``k1 v1 … kP vP``; then P queries, each a key drawn uniformly (with replacement) from
  the P keys, sit at random non-overlapping slots of the remaining positions, each followed by its value;
  other positions hold a filler token. The model is scored on predicting the value at each query position.
  Keys are drawn without replacement from ``[1, V/2)``, values with replacement from ``[V/2, V)``.
  (Zoology spaces the queries by a power law; here the slots are uniform. Queries are drawn with
  replacement: querying every key exactly once lets a model answer late queries by elimination — the
  one value not yet repeated — which a first probe of this runner learned instead of recall.)
* **ListOps** (Nangia & Bowman 2018; the generator rules of Long Range Arena, Tay et al. ICLR 2021):
  a tree whose nodes are digits 0–9 or ``[OP a1 … an ]`` with OP ∈ {MAX, MIN, MED, SM}, n ∈ [2, max_args];
  below max_depth a node is an operator with probability 1/4, else a digit; trees outside
  [min_length, max_length] tokens are redrawn. MED = ⌊median⌋ (LRA's ``int(np.median)``: the mean of the
  two middle values for an even count, truncated), SM = sum mod 10. The answer digit is predicted after
  a final ``=`` token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

IGNORE = -100  # the target of a position that is not scored

# ---------------------------------------------------------------------------------------------- MQAR


def mqar_example(keys: Iterable[int], values: Iterable[int], queries: Iterable[int], positions: Iterable[int],
                 seq_len: int, filler: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One MQAR sequence: pairs at 0..2P-1, then key ``keys[queries[j]]`` at ``positions[j]`` followed by its
    value. Returns (input_ids, targets) with ``targets[positions[j]] = values[queries[j]]``, -100 elsewhere."""
    keys, values, queries, positions = list(keys), list(values), list(queries), list(positions)
    p = len(keys)
    if len(values) != p or len(set(keys)) != p or not all(0 <= j < p for j in queries) \
            or len(positions) != len(queries):
        raise ValueError("mqar_example needs P distinct keys, P values, query indices in range(P) and one "
                         "position per query")
    ids = np.full(seq_len, filler, dtype=np.int64)
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    ids[0:2 * p:2], ids[1:2 * p:2] = keys, values
    used: set[int] = set()
    for j, pos in zip(queries, positions, strict=True):
        if pos < 2 * p or pos + 1 >= seq_len or {pos, pos + 1} & used:
            raise ValueError(f"query position {pos} overlaps the pairs, another query or the end")
        used |= {pos, pos + 1}
        ids[pos], ids[pos + 1], targets[pos] = keys[j], values[j], values[j]
    return ids, targets


def random_mqar(rng: np.random.Generator, seq_len: int, num_pairs: int, vocab_size: int
                ) -> tuple[np.ndarray, np.ndarray]:
    half = vocab_size // 2
    slots = (seq_len - 2 * num_pairs) // 2
    if half - 1 < num_pairs or slots < num_pairs:
        raise ValueError(f"mqar: {num_pairs} pairs do not fit vocab_size {vocab_size} / seq_len {seq_len}")
    keys = rng.choice(np.arange(1, half), num_pairs, replace=False)
    values = rng.integers(half, vocab_size, num_pairs)
    queries = rng.integers(0, num_pairs, num_pairs)
    positions = 2 * num_pairs + 2 * np.sort(rng.choice(slots, num_pairs, replace=False))
    return mqar_example(keys, values, queries, positions, seq_len)


# ------------------------------------------------------------------------------------------- ListOps

LISTOPS_TOKENS = ["<pad>", *[str(d) for d in range(10)], "[MIN", "[MAX", "[MED", "[SM", "]", "="]
LISTOPS_ID = {t: i for i, t in enumerate(LISTOPS_TOKENS)}
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VALUE_P = 0.25  # LRA: below max_depth a node is an operator with probability VALUE_P


def apply_op(op: str, args: list[int]) -> int:
    """LRA's operator rules: MIN, MAX, MED = int(median) (even count: mean of the middle two, truncated),
    SM = sum mod 10."""
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; valid: {list(OPERATORS)}")


def listops_value(tokens: list[str]) -> int:
    """Evaluate a ListOps token list such as ``"[MAX 2 9 [MIN 4 7 ] 0 ]".split()``."""
    stack: list[list] = [[None, []]]
    for tok in tokens:
        if tok in OPERATORS:
            stack.append([tok, []])
        elif tok == "]":
            op, args = stack.pop()
            if op is None or not args:
                raise ValueError(f"unbalanced ListOps expression {' '.join(tokens)!r}")
            stack[-1][1].append(apply_op(op, args))
        elif tok.isdigit() and len(tok) == 1:
            stack[-1][1].append(int(tok))
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if len(stack) != 1 or len(stack[0][1]) != 1:
        raise ValueError(f"ListOps expression {' '.join(tokens)!r} is not one balanced tree")
    return stack[0][1][0]


def random_tree(rng: np.random.Generator, depth: int, max_depth: int, max_args: int) -> list[str]:
    """Tokens of a random tree by LRA's rules (the root is at depth 1)."""
    if depth >= max_depth or rng.random() > VALUE_P:
        return [str(int(rng.integers(10)))]
    op = OPERATORS[int(rng.integers(len(OPERATORS)))]
    out = [op]
    for _ in range(int(rng.integers(2, max_args + 1))):
        out += random_tree(rng, depth + 1, max_depth, max_args)
    return out + ["]"]


def listops_example(tokens: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens =`` padded to ``seq_len``; the target (answer digit) sits at the ``=`` position."""
    if len(tokens) + 1 > seq_len:
        raise ValueError(f"ListOps expression of {len(tokens)} tokens does not fit seq_len {seq_len}")
    ids = np.zeros(seq_len, dtype=np.int64)
    ids[: len(tokens) + 1] = [LISTOPS_ID[t] for t in tokens] + [LISTOPS_ID["="]]
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    targets[len(tokens)] = LISTOPS_ID[str(listops_value(tokens))]
    return ids, targets


def random_listops(rng: np.random.Generator, min_length: int, max_length: int, max_depth: int, max_args: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    for _ in range(100_000):
        tokens = random_tree(rng, 1, max_depth, max_args)
        if min_length <= len(tokens) <= max_length:
            return listops_example(tokens, max_length + 1)
    raise ValueError(f"listops: no tree of {min_length}-{max_length} tokens at max_depth {max_depth}")
