"""CI checks of the built wheel on a machine without a GPU (tools/test.sh runs this):
the package imports (PyTorch or not), says why the kernels cannot run, every op names the
argument at fault, and a well-formed CUDA call fails with the reason CUDA is missing instead
of crashing. Exits 1 on any failure; prints one line per check."""

import os
import sys

import sparse_mla
from sparse_mla import _native

failures = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if not cond:
        failures.append(name)


def raises(name, fn, exc, *needles):
    try:
        fn()
    except exc as e:
        msg = str(e)
        check(name, all(n in msg for n in needles), msg)
        return msg
    except Exception as e:  # noqa: BLE001 - report the wrong kind
        check(name, False, f"raised {type(e).__name__}: {e}")
        return None
    check(name, False, "no exception")
    return None


def desc(shape, dtype, device="cuda", index=0, ptr=1 << 20, strides=None):
    if strides is None:
        strides, acc = [], 1
        for d in reversed(shape):
            strides.insert(0, acc)
            acc *= d
    return (ptr, tuple(shape), tuple(strides), dtype, device, index)


T, H, K = 4, 16, 100
q = desc([T, H, 576], "bfloat16")
kv = desc([10, 64, 576], "bfloat16")
kv8 = desc([10, 64, 656], "uint8")
idx = desc([T, K], "int32")
out = desc([T, H, 512], "bfloat16")
lse = desc([T, H], "float32")

why = sparse_mla.unavailable()
check("unavailable() gives a reason without a GPU", isinstance(why, str) and len(why) > 10, repr(why))
check("D_QK / D_V", (sparse_mla.D_QK, sparse_mla.D_V) == (576, 512))

# argument checks run before any device is touched, each naming the argument
raises("q on the CPU", lambda: _native.decode_plan(desc([T, H, 576], "bfloat16", "cpu", -1), kv, idx), ValueError, "`q`", "CUDA tensor", "cpu")
raises("q dtype", lambda: _native.decode_plan(desc([T, H, 576], "float16"), kv, idx), TypeError, "`q`", "bfloat16", "float16")
raises("q width", lambda: _native.decode_plan(desc([T, H, 512], "bfloat16"), kv, idx), ValueError, "`q`", "576")
raises("q not contiguous", lambda: _native.decode_plan(desc([T, H, 576], "bfloat16", strides=[H * 576 * 2, 576, 1]), kv, idx), ValueError, "`q`", "contiguous")
raises("q misaligned", lambda: _native.decode_plan(desc([T, H, 576], "bfloat16", ptr=(1 << 20) + 4), kv, idx), ValueError, "`q`", "aligned")
raises("cache on another device", lambda: _native.decode_plan(q, desc([10, 64, 576], "bfloat16", index=1), idx), ValueError, "`kv_cache`", "cuda:0", "cuda:1")
raises("cache row width", lambda: _native.decode_plan(q, desc([10, 64, 600], "uint8"), idx), ValueError, "`kv_cache`", "656")
raises("cache dtype", lambda: _native.decode_plan(q, desc([10, 64, 576], "float32"), idx), TypeError, "`kv_cache`", "uint8")
raises("cache rank", lambda: _native.decode_plan(q, desc([640, 576], "bfloat16"), idx), ValueError, "`kv_cache`", "3 dimensions")
raises("cache row stride not whole words", lambda: _native.decode_plan(q, desc([10, 64, 656], "uint8", strides=[64 * 658, 658, 1]), idx), ValueError, "row stride")
raises("indices dtype", lambda: _native.decode_plan(q, kv, desc([T, K], "int64")), TypeError, "`indices`", "int32", "int64")
raises("indices tokens", lambda: _native.decode_plan(q, kv, desc([T + 1, K], "int32")), ValueError, "`indices`", "T = q.shape[0]")
raises("topk_length shape", lambda: _native.decode_plan(q, kv, idx, desc([T + 2], "int32")), ValueError, "`topk_length`")
raises("topk 0", lambda: _native.decode_plan(q, kv, desc([T, 0], "int32")), ValueError, "topk")
raises("out heads", lambda: _native.decode(0, q, kv, idx, None, desc([T, H + 1, 512], "bfloat16"), lse, None, None, 0.1), ValueError, "`out`", "H = q.shape[1]")
raises("lse dtype", lambda: _native.decode(0, q, kv, idx, None, out, desc([T, H], "bfloat16"), None, None, 0.1), TypeError, "`lse`", "float32")
raises("scale", lambda: _native.decode(0, q, kv, idx, None, out, lse, None, None, -1.0), ValueError, "scale")
raises("cache_write slot dtype", lambda: _native.cache_write(0, desc([T, 512], "bfloat16"), desc([T, 64], "bfloat16"), desc([T], "int64"), kv8), TypeError, "`slot_mapping`", "int32")
raises("cache_write rope width", lambda: _native.cache_write(0, desc([T, 512], "bfloat16"), desc([T, 32], "bfloat16"), desc([T], "int32"), kv8), ValueError, "`rope`", "64")
raises("positions_to_slots table dtype", lambda: _native.positions_to_slots(0, idx, desc([2, 8], "int64"), desc([T], "int32"), idx, 64), TypeError, "`block_table`")
raises("positions_to_slots slots shape", lambda: _native.positions_to_slots(0, idx, desc([2, 8], "int32"), desc([T], "int32"), desc([T, K + 1], "int32"), 64), ValueError, "`slots`")

# a well-formed call reaches the device and reports why it cannot run
for name, fn in [
    ("decode_plan", lambda: _native.decode_plan(q, kv8, idx)),
    ("decode", lambda: _native.decode(0, q, kv, idx, None, out, lse, None, None, 0.0625)),
    ("cache_write", lambda: _native.cache_write(0, desc([T, 512], "bfloat16"), desc([T, 64], "bfloat16"), desc([T], "int32"), kv8)),
    ("positions_to_slots", lambda: _native.positions_to_slots(0, idx, desc([2, 8], "int32"), desc([T], "int32"), idx, 64)),
]:
    raises(f"{name} without a GPU says why", fn, RuntimeError, "unavailable")

try:
    import torch
except ImportError:
    torch = None
if torch is None:
    raises("ops without PyTorch", lambda: sparse_mla.decode(None, None, None, 0.1), ImportError, "torch")
    print("(PyTorch not installed: the torch.library checks run on the GPU machine, python/tests/test_gpu.py)")
else:
    qc = torch.zeros(T, H, 576, dtype=torch.bfloat16)
    raises("torch: CPU q", lambda: sparse_mla.decode(qc, torch.zeros(10, 64, 576, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int32), 0.1), ValueError, "`q`", "CUDA")
    check("torch: op registered", hasattr(torch.ops.sparse_mla, "decode"))

print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s) ({os.path.basename(sys.argv[0])})")
sys.exit(1 if failures else 0)
