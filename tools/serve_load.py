#!/usr/bin/env python3
"""A bounded load run against a running mla-serve (or any OpenAI-compatible server).

Fires --requests streaming /v1/completions requests, --concurrency at a time, stops starting
new ones after --time-limit seconds, and prints what the clients saw: generated tokens per
second over the whole run, time to first token (TTFT) and inter-token latency (ITL) p50 / p99.
Python standard library only (it runs on machines with no network and no extra packages), and
only against the address given (loopback by default).

  tools/serve_load.py --url http://127.0.0.1:8000 --requests 64 --concurrency 8
  tools/serve_load.py --wait-health 60            # wait until /health answers, then exit
  tools/serve_load.py --check 8                   # is a greedy answer the same alone and in a batch of 8?

Token counts come from the server's `token_ids` (the vLLM extension mla-serve implements);
a server without it is counted one token per streamed chunk.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse


def percentile(values, q):
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def connect(url, timeout):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def get(url, path, timeout):
    c = connect(url, timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def stream_completion(url, body, timeout):
    """One streamed request: (ok, error, t_sent, [(t_arrival, tokens_in_chunk)], ids)."""
    c = connect(url, timeout)
    chunks, ids = [], []
    t0 = time.monotonic()
    try:
        c.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        r = c.getresponse()
        if r.status != 200:
            return False, f"HTTP {r.status}: {r.read()[:200]!r}", t0, chunks, ids
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return True, None, t0, chunks, ids
            ev = json.loads(data)
            if "error" in ev:
                return False, ev["error"].get("message", "error"), t0, chunks, ids
            for ch in ev.get("choices", []):
                got = ch.get("token_ids")
                n = len(got) if got is not None else (1 if ch.get("text") else 0)
                if got:
                    ids.extend(got)
                if n:
                    chunks.append((time.monotonic(), n))
        return False, "the stream ended without [DONE]", t0, chunks, ids
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        return False, f"{type(e).__name__}: {e}", t0, chunks, ids
    finally:
        c.close()


def request_body(args, i):
    # Distinct prompts of --prompt-tokens ids, so no two requests are the same sequence.
    prompt = [1 + (i * 7919 + k * 104729) % (args.vocab - 1) for k in range(args.prompt_tokens)]
    return {
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def load(args):
    lock = threading.Lock()
    state = {"next": 0}
    results = []
    deadline = time.monotonic() + args.time_limit

    def worker():
        while True:
            with lock:
                i = state["next"]
                if i >= args.requests or time.monotonic() >= deadline:
                    return
                state["next"] += 1
            res = stream_completion(args.url, request_body(args, i), args.timeout)
            with lock:
                results.append(res)

    t_start = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        # A request never outlives its socket timeout; join with a bound all the same.
        t.join(max(0.0, deadline - time.monotonic()) + args.timeout + 5)
    wall = time.monotonic() - t_start

    ok = [r for r in results if r[0]]
    errors = [r[1] for r in results if not r[0]]
    tokens = sum(n for r in results for _, n in r[3])
    ttft = [r[3][0][0] - r[2] for r in results if r[3]]
    itl = []
    for r in results:
        for (ta, _), (tb, nb) in zip(r[3], r[3][1:]):
            itl.extend([(tb - ta) / nb] * nb)
    return {
        "concurrency": args.concurrency,
        "requests": len(results),
        "ok": len(ok),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)),
        "itl_p99_ms": ms(percentile(itl, 99)),
        "unfinished": args.requests - len(results),
    }


def ms(s):
    return None if s is None else s * 1e3


def fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def check(args, n):
    """The same greedy prompt alone, then n copies at once: are the token ids the same?"""
    body = request_body(args, 0)
    ok, err, _, _, alone = stream_completion(args.url, body, args.timeout)
    if not ok:
        print(f"check: the lone request failed: {err}")
        return 1
    outs = [None] * n

    def one(k):
        outs[k] = stream_completion(args.url, body, args.timeout)

    ts = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(args.timeout + 5)
    same = 0
    first_diff = None
    for o in outs:
        if o and o[0] and o[4] == alone:
            same += 1
        elif o and o[0] and first_diff is None:
            first_diff = next((k for k, (a, b) in enumerate(zip(alone, o[4])) if a != b), None)
    line = f"check: {same} of {n} batched copies equal the lone answer ({len(alone)} tokens)"
    if first_diff is not None:
        line += f"; first difference at token {first_diff}"
    print(line)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    ap.add_argument("--requests", type=int, default=32, help="requests to send at most")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in token ids")
    ap.add_argument("--vocab", type=int, default=384, help="prompt ids are drawn below this")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds after which no new request starts")
    ap.add_argument("--timeout", type=float, default=30.0, help="socket timeout of one request, seconds")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--row", metavar="NAME", help="print a markdown table row named NAME (the summary goes to stderr)")
    ap.add_argument("--wait-health", type=float, metavar="S", help="wait up to S seconds for GET /health = 200, then exit")
    ap.add_argument("--check", type=int, metavar="N", help="compare a greedy answer alone and in a batch of N")
    args = ap.parse_args()

    host = urllib.parse.urlparse(args.url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        print(f"serve_load: {host} is not a loopback address; this tool only loads local servers", file=sys.stderr)
        return 2

    if args.wait_health is not None:
        end = time.monotonic() + args.wait_health
        while time.monotonic() < end:
            try:
                status, _ = get(args.url, "/health", 2)
                if status == 200:
                    return 0
            except OSError:
                pass
            time.sleep(0.2)
        print(f"serve_load: {args.url}/health did not answer 200 within {args.wait_health:.0f} s", file=sys.stderr)
        return 1
    if args.check:
        return check(args, args.check)

    r = load(args)
    if args.json:
        print(json.dumps(r))
    else:
        print(
            ("" if not args.row else f"{args.row} ") +
            f"c={r['concurrency']}: {r['ok']}/{r['requests']} ok, {r['tokens']} tokens in {r['seconds']:.2f} s = "
            f"{r['tokens_per_s']:.1f} tok/s | TTFT p50 {fmt(r['ttft_p50_ms'])} ms p99 {fmt(r['ttft_p99_ms'])} ms | "
            f"ITL p50 {fmt(r['itl_p50_ms'], '.2f')} ms p99 {fmt(r['itl_p99_ms'], '.2f')} ms"
            + (f" | first error: {r['first_error']}" if r["first_error"] else ""),
            file=sys.stderr if args.row else sys.stdout,
        )
    if args.row:
        print(
            f"| {args.row} | {r['concurrency']} | {r['ok']}/{r['requests']} | {r['tokens_per_s']:.0f} | "
            f"{fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'], '.2f')} | "
            f"{fmt(r['itl_p99_ms'], '.2f')} |" + (f" {r['first_error']}" if r["first_error"] else "")
        )
    return 0 if r["failed"] == 0 and r["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
