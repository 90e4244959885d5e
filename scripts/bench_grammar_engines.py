#!/usr/bin/env python3
"""Benchmark grammar engines (llguidance, xgrammar) for constrained decoding on CPU.

Runs under any venv: an engine that cannot be imported is skipped (with the reason).

Measures, per engine, with a given HF tokenizer directory (tokenizer.json +
tokenizer_config.json; e.g. a 128k byte-level BPE):
  * tokenizer-info build time
  * JSON-schema compile time (3 schemas) and first-mask time
  * per-token mask time while walking a valid output (median / p90, 20 reps)
  * draft-tree mask time for 1,024 nodes (BFS and DFS order; move by
    rollback+consume, or by forking the parent matcher)
  * rollback cost of 1 and 16 tokens, and fork/deep_copy cost

Both engines are set to compact JSON (no flexible whitespace, "," and ":"
separators), and additional properties follow JSON-schema semantics
(xgrammar strict_mode=False), so the grammars accept the same language.

Usage:
  python scripts/bench_grammar_engines.py --tokenizer /tmp/ge/tok128k [--engines llguidance,xgrammar]

A missing --tokenizer folder is built first: a byte-level BPE of 128,000 entries trained
on this machine's Python sources and docs (about 150 MB of text, two minutes on 2 cores).
xgrammar needs transformers, tvm-ffi and triton at run time: run it from a venv of its
own (pip install xgrammar there); specd's venv has llguidance only.
"""

import argparse
import gc
import json
import statistics
import sys
import time

SCHEMA_A = {"type": "object"}
SCHEMA_B = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
SCHEMA_C = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SCHEMAS = [("a_any_object", SCHEMA_A), ("b_person", SCHEMA_B), ("c_tool_call", SCHEMA_C)]
VALID_B = {"name": "Alice", "age": 30, "color": "red", "tags": ["a", "b"]}

now = time.perf_counter_ns


def us(ns):
    return ns / 1e3


def pct(xs, p):
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100.0 * (len(xs) - 1))))
    return xs[k]


# --------------------------------------------------------------------------- engines


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, hf_tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.version = llguidance.get_version() if hasattr(llguidance, "get_version") else "?"
        self._fill = llguidance.torch.fill_next_token_bitmask
        t = now()
        self.tok = llguidance.hf.from_tokenizer(hf_tok)
        self.info_ns = now() - t
        self.vocab_size = self.tok.vocab_size
        self.stop_ids = set(self.tok.eos_tokens)
        self.allocate = llguidance.torch.allocate_token_bitmask

    def compile(self, schema):
        M = self.llg.LLMatcher
        g = M.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
        )
        m = M(self.tok, g, log_level=1)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        # compile() already returns a fresh matcher; make independent ones via deep_copy
        return compiled.deep_copy()

    def fill(self, m, bm):
        self._fill(m, bm, 0)

    def consume(self, m, t):
        return m.consume_token(t)

    def rollback(self, m, n):
        m.rollback(n)

    def reset(self, m):
        m.reset()

    def fork(self, m):
        return m.deep_copy()

    def error(self, m):
        return m.get_error() if m.is_error() else None


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, hf_tok):
        import xgrammar as xgr

        self.xgr = xgr
        self.version = getattr(xgr, "__version__", "?")
        t = now()
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
        self.info_ns = now() - t
        self.vocab_size = self.info.vocab_size
        self.stop_ids = set(self.info.stop_token_ids)
        # cache disabled so every compile is measured cold
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.allocate = xgr.allocate_token_bitmask

    def compile(self, schema):
        cg = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False
        )
        return self.xgr.GrammarMatcher(cg)

    def matcher(self, compiled):
        return compiled.fork() if hasattr(compiled, "fork") else None

    def fill(self, m, bm):
        m.fill_next_token_bitmask(bm, 0)

    def consume(self, m, t):
        return m.accept_token(t)

    def rollback(self, m, n):
        m.rollback(n)

    def reset(self, m):
        m.reset()

    def fork(self, m):
        return m.fork()

    def error(self, m):
        return None


ENGINES = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}

# --------------------------------------------------------------------------- helpers


def allowed(bm_np, k, stop_ids, pops=None):
    """First k allowed (non-stop) token ids in row 0 of the bitmask."""
    import numpy as np

    bits = np.unpackbits(bm_np.view(np.uint8), bitorder="little")
    if pops is not None:
        pops.append(int(bits.sum()))
    out = []
    for t in np.flatnonzero(bits):
        t = int(t)
        if t in stop_ids:
            continue
        out.append(t)
        if len(out) == k:
            break
    return out


def is_allowed(bm_np, t):
    return bool((int(bm_np[t >> 5]) >> (t & 31)) & 1)


def popcount(bm_np):
    import numpy as np

    return int(np.unpackbits(bm_np.view(np.uint8)).sum())


# --------------------------------------------------------------------------- benchmarks


def bench_compile(eng, reps):
    rows = []
    compiled = {}
    bm = eng.allocate(1, eng.vocab_size)
    for name, schema in SCHEMAS:
        times, firsts, err = [], [], None
        for _ in range(reps):
            gc.collect()
            try:
                t = now()
                m = eng.compile(schema)
                t1 = now()
                eng.fill(m, bm)
                t2 = now()
            except Exception as e:  # record rejection
                err = f"{type(e).__name__}: {e}"[:300]
                break
            times.append(t1 - t)
            firsts.append(t2 - t1)
            compiled[name] = m
        rows.append((name, times, firsts, err))
    return rows, compiled


def bench_walk(eng, m, tokens, reps):
    bm = eng.allocate(1, eng.vocab_size)
    bmn = bm[0].numpy()
    samples, pops = [], []
    for r in range(reps):
        eng.reset(m)
        for i, t in enumerate(tokens):
            s = now()
            eng.fill(m, bm)
            samples.append(now() - s)
            if r == 0:
                pops.append(popcount(bmn))
                if not is_allowed(bmn, t):
                    raise RuntimeError(f"token {t} at pos {i} not allowed by mask")
            if not eng.consume(m, t):
                raise RuntimeError(f"consume failed at pos {i}: {eng.error(m)}")
        s = now()
        eng.fill(m, bm)
        samples.append(now() - s)
        if r == 0:
            pops.append(popcount(bmn))
            stop_ok = any(is_allowed(bmn, t) for t in eng.stop_ids)
    eng.reset(m)
    return samples, pops, stop_ok


def bench_tree(eng, compiled_m, n_nodes, order, strategy, k=4, fixed=None):
    """Draft tree of n_nodes mask computations, children = first k allowed ids.

    strategy 'rollback': one matcher, moved between nodes by rollback to the
    common ancestor then consuming the path tokens.
    strategy 'fork': each node's matcher = fork(parent) + consume(token).
    Returns (total_ns moves+masks, move_ns, mask_ns, max_depth, wall_ns).
    """
    from collections import deque

    bm = eng.allocate(1, eng.vocab_size)
    bmn = bm[0].numpy()
    # node: (parent_index, token, depth)
    parent, token, depth = [-1], [None], [0]
    frontier = deque([0])
    if fixed is not None:  # replay a saved tree: same nodes, same visiting order
        parent, token = fixed["parent"], fixed["token"]
        depth = [0] * len(parent)
        for i in range(1, len(parent)):
            depth[i] = depth[parent[i]] + 1
        frontier = deque(fixed["processed"])
        order = "bfs"  # pop from the left = saved order
    move_ns = mask_ns = 0
    done = 0
    max_depth = 0
    processed, pops = [], []
    wall0 = now()
    if strategy == "rollback":
        m = eng.matcher(compiled_m)
        eng.reset(m)
        cur_path = []  # node indices from root's child down to current node

        def path_of(n):
            p = []
            while n > 0:
                p.append(n)
                n = parent[n]
            p.reverse()
            return p
    else:
        root_m = eng.matcher(compiled_m)
        eng.reset(root_m)
        mats = {0: root_m}
    while frontier and done < n_nodes:
        n = frontier.popleft() if order == "bfs" else frontier.pop()
        if strategy == "rollback":
            tgt = path_of(n)
            lcp = 0
            lim = min(len(tgt), len(cur_path))
            while lcp < lim and tgt[lcp] == cur_path[lcp]:
                lcp += 1
            toks = [token[x] for x in tgt[lcp:]]
            s = now()
            if len(cur_path) > lcp:
                eng.rollback(m, len(cur_path) - lcp)
            ok = True
            for t in toks:
                ok = eng.consume(m, t) and ok
            e = now()
            if not ok:
                raise RuntimeError(f"consume failed moving to node {n}")
            cur_path = tgt
            mm = m
        else:
            ok = True
            s = now()
            if n == 0:
                mm = mats[0]
            else:
                mm = eng.fork(mats[parent[n]])
                ok = eng.consume(mm, token[n])
                mats[n] = mm
            e = now()
            if not ok:
                raise RuntimeError(f"consume failed at node {n}")
        eng.fill(mm, bm)
        f = now()
        move_ns += e - s
        mask_ns += f - e
        done += 1
        max_depth = max(max_depth, depth[n])
        processed.append(n)
        kids = allowed(bmn, k, eng.stop_ids, pops)
        if fixed is not None:
            continue
        ids = []
        for t in kids:
            parent.append(n)
            token.append(t)
            depth.append(depth[n] + 1)
            ids.append(len(parent) - 1)
        if order == "dfs":
            ids.reverse()  # first child popped first
        frontier.extend(ids)
    wall = now() - wall0
    tree = {"parent": parent, "token": token, "processed": processed, "pops": pops}
    return move_ns + mask_ns, move_ns, mask_ns, max_depth, done, wall, tree


def bench_native_tree(eng, compiled_m, tree, reps=3):
    """xgrammar only: GrammarMatcher.traverse_draft_tree over the same processed nodes."""
    import torch

    proc = sorted(tree["processed"])  # creation order: parents before children
    idx = {n: i for i, n in enumerate(proc)}
    N = len(proc)
    nxt = torch.full((N,), -1, dtype=torch.int64)
    sib = torch.full((N,), -1, dtype=torch.int64)
    toks = torch.zeros((N,), dtype=torch.int64)
    last_child = {}
    for n in proc:
        i = idx[n]
        if n == 0:
            continue
        toks[i] = tree["token"][n]
        p = idx[tree["parent"][n]]
        if p in last_child:
            sib[last_child[p]] = i
        else:
            nxt[p] = i
        last_child[p] = i
    bm = eng.allocate(N, eng.vocab_size)
    m = eng.matcher(compiled_m)
    times = []
    for _ in range(reps):
        eng.reset(m)
        s = now()
        m.traverse_draft_tree(nxt, sib, toks, bm)
        times.append(now() - s)
    # check against the per-node masks computed step by step
    import numpy as np

    ref = {n: c for n, c in zip(tree["processed"], tree["pops"], strict=False)}
    got = np.unpackbits(bm.numpy().view(np.uint8), axis=1).sum(axis=1)
    mism = sum(1 for n in proc if int(got[idx[n]]) != ref[n])
    return times, N, mism


def bench_rollback(eng, compiled_m, tokens, reps):
    m = eng.matcher(compiled_m)
    eng.reset(m)
    n = len(tokens)
    for t in tokens:
        eng.consume(m, t)
    res = {}
    for k in (1, 16):
        if k > n:
            res[k] = None
            continue
        xs = []
        for _ in range(reps):
            s = now()
            eng.rollback(m, k)
            xs.append(now() - s)
            for t in tokens[n - k :]:
                eng.consume(m, t)
        res[k] = xs
    # re-consume cost for comparison (16 tokens)
    xs = []
    for _ in range(reps):
        eng.rollback(m, min(16, n))
        s = now()
        for t in tokens[n - min(16, n) :]:
            eng.consume(m, t)
        xs.append(now() - s)
    res["consume16"] = xs
    # fork cost at the end state
    xs = []
    for _ in range(reps):
        s = now()
        c = eng.fork(m)
        xs.append(now() - s)
        del c
    res["fork"] = xs
    return res


# --------------------------------------------------------------------------- main


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def build_tokenizer(folder, vocab_size=128_000, max_chars=150e6):
    """A realistic byte-level BPE (GPT-2/Llama-3 style) trained on the Python sources and
    docs found under sys.prefix and the standard library, saved to `folder`."""
    import os
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    roots = {sysconfig.get_paths()["stdlib"], sys.prefix}
    seen, total = set(), 0

    def texts():
        nonlocal total
        for root in sorted(roots):
            for path, _, files in os.walk(root):
                for name in files:
                    if not name.endswith((".py", ".txt", ".rst", ".md", ".pyi")):
                        continue
                    real = os.path.realpath(os.path.join(path, name))
                    if real in seen or total > max_chars:
                        continue
                    seen.add(real)
                    try:
                        with open(real, encoding="utf-8", errors="ignore") as f:
                            text = f.read()
                    except OSError:
                        continue
                    total += len(text)
                    yield text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"built {folder}: {tok.get_vocab_size()} tokens from {total / 1e6:.0f} MB of text")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="/tmp/ge/tok128k")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--walk-reps", type=int, default=20)
    ap.add_argument("--compile-reps", type=int, default=3)
    ap.add_argument("--tree-nodes", type=int, default=1024)
    ap.add_argument("--rollback-reps", type=int, default=200)
    ap.add_argument("--json", default=None, help="write raw results here")
    ap.add_argument(
        "--tree-save", default=None, help="save the built BFS/DFS trees (first engine run) as JSON"
    )
    ap.add_argument(
        "--tree-load",
        default=None,
        help="replay saved trees instead of building them from each engine's own masks",
    )
    args = ap.parse_args()

    import os

    import transformers

    if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
        build_tokenizer(args.tokenizer)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    text = json.dumps(VALID_B, separators=(",", ":"))
    tokens = hf_tok.encode(text, add_special_tokens=False)
    print(f"python {sys.version.split()[0]}  transformers {transformers.__version__}")
    print(f"tokenizer {args.tokenizer}: len={len(hf_tok)} eos={hf_tok.eos_token_id}")
    print(f"walk text ({len(tokens)} tokens): {text}")
    print("tokens:", [hf_tok.decode([t]) for t in tokens])
    out = {}
    for ename in args.engines.split(","):
        print(f"\n=== {ename} ===")
        try:
            eng = ENGINES[ename](hf_tok)
        except Exception as e:
            print(f"SKIP {ename}: cannot import/initialise: {type(e).__name__}: {e}")
            out[ename] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        r = {"version": eng.version, "tokenizer_info_ms": eng.info_ns / 1e6}
        print(
            f"version {eng.version}; vocab_size {eng.vocab_size}; stop ids {sorted(eng.stop_ids)}"
        )
        print(f"tokenizer info build: {eng.info_ns / 1e6:.1f} ms")

        rows, compiled = bench_compile(eng, args.compile_reps)
        r["compile"] = {}
        for name, times, firsts, err in rows:
            if err:
                print(f"compile {name}: REJECTED/FAILED: {err}")
                r["compile"][name] = {"error": err}
                continue
            print(
                f"compile {name}: first {times[0] / 1e6:.2f} ms, median {statistics.median(times) / 1e6:.2f} ms"
                f" (n={len(times)}); first mask after compile: median {statistics.median(firsts) / 1e3:.0f} us"
                f" (first {firsts[0] / 1e3:.0f} us)"
            )
            r["compile"][name] = {
                "ms": [x / 1e6 for x in times],
                "first_mask_us": [x / 1e3 for x in firsts],
            }
        if "b_person" not in compiled:
            out[ename] = r
            continue
        mb = compiled["b_person"]

        samples, pops, stop_ok = bench_walk(eng, mb, tokens, args.walk_reps)
        P = len(tokens) + 1
        per_pos = [
            statistics.median(samples[r * P + i] for r in range(args.walk_reps)) for i in range(P)
        ]
        print(
            f"mask/token (schema b, {len(tokens) + 1} masks x {args.walk_reps}): median {us(statistics.median(samples)):.1f} us,"
            f" p90 {us(pct(samples, 90)):.1f} us, max {us(max(samples)):.0f} us; stop allowed at end: {stop_ok}"
        )
        print(
            f"  mean {us(statistics.fmean(samples)):.1f} us/mask; all {P} masks of one output: {us(sum(per_pos)) / 1e3:.2f} ms (sum of per-position medians)"
        )
        print(f"  per-position median us: {[round(us(x), 1) for x in per_pos]}")
        print(f"allowed-token counts per position: {pops}")
        r["walk"] = {
            "median_us": us(statistics.median(samples)),
            "p90_us": us(pct(samples, 90)),
            "max_us": us(max(samples)),
            "mean_us": us(statistics.fmean(samples)),
            "per_pos_median_us": [us(x) for x in per_pos],
            "popcounts": pops,
            "stop_allowed_at_end": stop_ok,
        }

        r["tree"] = {}
        saved = {}
        loaded = None
        if args.tree_load:
            with open(args.tree_load) as f:
                loaded = json.load(f)
            print(f"replaying trees from {args.tree_load} (built by {loaded.get('engine')})")
        for strategy in ("rollback", "fork"):
            for order in ("bfs", "dfs"):
                gc.collect()
                try:
                    fixed = loaded[order] if loaded else None
                    tot, mv, mk, dmax, done, wall, tree = bench_tree(
                        eng, mb, args.tree_nodes, order, strategy, fixed=fixed
                    )
                    if strategy == "rollback" and fixed is None:
                        saved[order] = {k2: tree[k2] for k2 in ("parent", "token", "processed")}
                except Exception as e:
                    print(f"tree {strategy}/{order}: FAILED {type(e).__name__}: {e}")
                    r["tree"][f"{strategy}/{order}"] = {"error": str(e)}
                    continue
                print(
                    f"tree {strategy:8s}/{order}: {done} nodes, max depth {dmax}: total {tot / 1e6:.1f} ms"
                    f" = {us(tot) / done:.1f} us/node (moves {us(mv) / done:.1f} + mask {us(mk) / done:.1f});"
                    f" wall incl. child picking {wall / 1e6:.1f} ms"
                )
                r["tree"][f"{strategy}/{order}"] = {
                    "nodes": done,
                    "max_depth": dmax,
                    "total_ms": tot / 1e6,
                    "us_per_node": us(tot) / done,
                    "move_us": us(mv) / done,
                    "mask_us": us(mk) / done,
                }
                if strategy == "rollback" and hasattr(mb, "traverse_draft_tree"):
                    try:
                        times, N, mism = bench_native_tree(eng, mb, tree)
                        med = statistics.median(times)
                        print(
                            f"tree native  /{order}: traverse_draft_tree over the same {N} nodes: {med / 1e6:.1f} ms"
                            f" = {us(med) / N:.1f} us/node (median of {len(times)}); popcount mismatches vs step-by-step: {mism}"
                        )
                        r["tree"][f"native/{order}"] = {
                            "nodes": N,
                            "total_ms": med / 1e6,
                            "us_per_node": us(med) / N,
                            "mismatches": mism,
                        }
                    except Exception as e:
                        print(f"tree native/{order}: FAILED {type(e).__name__}: {e}")

        if args.tree_save and saved:
            saved["engine"] = ename
            with open(args.tree_save, "w") as f:
                json.dump(saved, f)
            print(f"saved trees to {args.tree_save}")
        rb = bench_rollback(eng, mb, tokens, args.rollback_reps)
        parts = []
        for k in (1, 16, "consume16", "fork"):
            if rb.get(k):
                parts.append(f"{k}: median {us(statistics.median(rb[k])):.2f} us")
        print("rollback/fork (schema b, at end of walk): " + "; ".join(parts))
        r["rollback"] = {str(k): (us(statistics.median(v)) if v else None) for k, v in rb.items()}
        out[ename] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
