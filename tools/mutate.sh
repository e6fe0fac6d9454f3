#!/usr/bin/env bash
# Mutation run over the kernels, emitters, lowerings and the tests that guard them: each
# mutation below is one deliberate bug, applied alone to a clean tree, followed by the tests
# that should catch it; a mutation "survives" when they still pass. Prints a table
# (mutation | file | tests | killed?) and exits 1 if any survived.
#
#   tools/mutate.sh            the fast tests per mutation (the emulator on a subset of cases)
#   tools/mutate.sh --full     tools/test.sh (the whole CI suite) after each mutation
#   tools/mutate.sh --check    only that each mutation's text occurs exactly once in its file
#                              (seconds; tools/test.sh runs it, so an entry the code moved
#                              away from fails CI instead of reporting NOT APPLIED later)
#   MUTATE_ONLY=text           only the mutations whose name contains it
#
# Needs a clean working tree for the mutated files (each is restored with `git checkout`).
set -uo pipefail
cd "$(dirname "$0")/.."
FULL=0
CHECK=0
case "${1:-}" in
  --full) FULL=1 ;;
  --check) CHECK=1 ;;
  "") ;;
  *) echo "mutate.sh: unknown argument '$1' (use --full, --check or nothing)" >&2; exit 2 ;;
esac
export LD_LIBRARY_PATH="$PWD/target/nvrtc/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# the emulator cases a mutation run uses: long top-k lists (rings wrap), fp8, splits, masks
export SPARSE_MLA_EMU_CASE=${SPARSE_MLA_EMU_CASE:-k2048}

# name # file # python-literal old # python-literal new # tests (cargo test args)
MUTATIONS=(
  "pack_bf16x2 operands swapped#src/emit/cuda.rs#': \"=r\"(r) : \"f\"(hi), \"f\"(lo));'#': \"=r\"(r) : \"f\"(lo), \"f\"(hi));'#--test mma_emulated"
  "v6 ring: no write-after-read barrier at the end of a step#src/kir/lower_mma/pipeline.rs#'        // Barrier: the next iteration\\'s load overwrites the stage computed on one step ago.\n        body.push(Stmt::Barrier);'#'        // mutation'#--test mma_emulated"
  "v7 ring: consumers wait for the wrong phase#src/kir/lower_mma/ws.rs#'parity: bin(BinOp::BitAnd, bin(BinOp::Div, itv.clone(), u(s)), u(1)),'#'parity: bin(BinOp::BitXor, bin(BinOp::BitAnd, bin(BinOp::Div, itv.clone(), u(s)), u(1)), u(1)),'#--test mma_emulated"
  "ring release: the producer refills a stage without waiting for its release (one-stage and warp-group rings)#src/kir/lower_mma/ws.rs#'cond: bin(BinOp::Ge, itv.clone(), u(1)),'#'cond: bin(BinOp::Ge, itv.clone(), u(1_000_000)),'#--test mma_emulated"
  "e4m3 widening: bytes of the k pairs swapped#src/kir/lower_mma/e4m3.rs#'    (stmts, pack(prep[0]), pack(prep[1]))'#'    (stmts, pack(prep[1]), pack(prep[0]))'#--test mma_emulated"
  "P x scale: the k+8 scales used for k#src/kir/lower_mma/e4m3.rs#'                (sv(0), sv(1))\n            } else {\n                (sv(2), sv(3))'#'                (sv(2), sv(3))\n            } else {\n                (sv(0), sv(1))'#--test mma_emulated"
  "split-K sum drops the last slice (fragments and rows)#src/kir/lower_mma/ksplit.rs#'        for_const(\n            g,\n            gk,'#'        for_const(\n            g,\n            gk - 1,'#--test mma_emulated"
  "scores held in rows: a row's max over half its lanes#src/kir/lower_mma/rows.rs#'b.extend(self.lanes_reduce(&x, rf.lanes, BinOp::Max));'#'b.extend(self.lanes_reduce(&x, rf.lanes / 2, BinOp::Max));'#--test mma_emulated"
  "scores held in rows: the state written without the warp's lanes meeting (a group of no steps)#src/kir/lower_mma/rows.rs#'        b.push(intr(Intrinsic::SyncWarp));\n'#'\n'#--test mma_emulated"
  "scores held in rows: the outputs rescaled by the factor of row 0#src/kir/lower_mma/rows.rs#'                    value: shared_load(&table, Ty::F32, ra.row.clone()),'#'                    value: shared_load(&table, Ty::F32, u(0)),'#--test mma_emulated"
  "split-K sum: a holder warp sums its first m fragment only (S 32 x 64 on 4 warps)#src/kir/lower_mma/ksplit.rs#'            info.frags(),'#'            info.fnw,'#--test mma_emulated"
  "mask ignores the recorded validity#src/kernels/sparse_mla_decode/split.rs#'.gt(f(0.5));'#'.gt(f(-0.5));'#--test mma_emulated --test conformance"
  "lse never written (v7 description)#src/kernels/sparse_mla_decode/io.rs#'                    b.store(&io.lse_out, at, v);'#'                    let _ = (at, v);'#--test formats_fp8_decode --test mma_emulated"
  "fp8 scale of tile k+1 used for tile k#src/kernels/sparse_mla_decode/split.rs#'|_, r| scales.at(r, u(k)),'#'|_, r| scales.at(r, u((k + 1) % 4)),'#--test mma_emulated --test conformance"
  "e4m3 decode: exponent bias off by one#src/emit/cuda.rs#'__uint_as_float(((e + 120u) << 23) | (m << 20));'#'__uint_as_float(((e + 121u) << 23) | (m << 20));'#--test mma_emulated"
  "warp groups: no barrier between the merge factors and their use#src/kir/lower_mma/groups.rs#'    out.push(Stmt::Barrier);\n    // the accumulators meet'#'    // the accumulators meet'#--test mma_emulated"
  "ring release: every thread arrives, the empty mbarrier expects one per warp#src/kir/lower_mma/ws.rs#'                index: u(stages + s),\n                count: readers,'#'                index: u(stages + s),\n                count: readers / WARP,'#--test mma_emulated"
  "head groups over one ring: the release expects one group's threads#src/kir/lower_mma/ws.rs#'let readers = threads * groups;'#'let readers = threads;'#--test mma_emulated two_head_groups"
  "head groups over one ring: the producers refill a stage without its release#src/kir/lower_mma/ws.rs#'let released = self.groups > 1 ||'#'let released = self.deals_steps() ||'#--test mma_emulated two_head_groups"
  "head groups over one ring: every group fills the same rows (the others' never)#src/kir/lower_mma/ws/producer.rs#'lane = add(mul(lane, u(cx.groups)), group);'#'lane = add(mul(lane, u(cx.groups)), {let _ = group; u(0)});'#--test mma_emulated two_head_groups"
  "V x scale (sm_80/90 P . V): the k+8 scales used for k#src/kir/lower_mma/e4m3.rs#'.map(|k| (k[2 * i].clone(), k[2 * i + 1].clone()))'#'.map(|k| (k[2 - 2 * i].clone(), k[3 - 2 * i].clone()))'#--test mma_emulated"
  "fp8 whole row: the scales window 16 bytes late (inside the rope)#src/kernels/sparse_mla_decode/split.rs#'                TileElem::F32,\n                latent,'#'                TileElem::F32,\n                latent + 16,'#--test mma_emulated"
  "ring: a row without a source is not zeroed (NaN garbage reaches P . V)#src/kir/lower_mma/ws/producer.rs#'                els: zero_row,'#'                els: { let _ = zero_row; vec![] },'#--test mma_emulated"
  "L2 prefetch: rows without a source asked for too (an address outside the cache)#src/kir/lower_mma/gather.rs#'cond: bin(BinOp::Ge, nv.clone(), Expr::I32(0)),'#'cond: bin(BinOp::Ge, nv.clone(), Expr::I32(i32::MIN)),'#--test mma_emulated"
  "epilogue: the rows read l, not its reciprocal#src/kernels/sparse_mla_decode/io.rs#'if per_row { l } else { inv_of(l) }'#'if per_row { inv_of(l) } else { inv_of(l) }'#--test mma_emulated"
  "pair store: the partial pair's second value written as its first#src/kernels/sparse_mla_decode/io.rs#'b.store_f32x2(&io.o_part, at, y0, y1);'#'b.store_f32x2(&io.o_part, at, y0.clone(), y0);'#--test mma_emulated"
  "f16 P . V: the accumulators not rescaled when the running scale K changes#src/kir/lower_mma/e4m3.rs#'        then.extend(self.units_scale_all(units, var(&ratio, Ty::F32))?);'#'        let _ = &ratio;'#--test mma_emulated"
  "f16 P . V: K never raised for tiny scales (their r flushed in f16)#src/kir/lower_mma/e4m3.rs#'bin(BinOp::Lt, mkv, Expr::F32(UNITS_LIMIT * UNITS_LOW))'#'bin(BinOp::Lt, mkv, Expr::F32(0.0))'#--test mma_emulated"
  "f16 P . V: the running scale's warp max over half the lanes (K differs between the halves)#src/kir/lower_mma/e4m3.rs#'let mut then = self.lanes_reduce(&m, WARP, BinOp::Max);'#'let mut then = self.lanes_reduce(&m, WARP / 2, BinOp::Max);'#--test mma_emulated"
  "f16 P . V: the accumulators left times K after the pipeline#src/kir/lower_mma/e4m3.rs#'        out.extend(self.units_scale_all(&units, var(&inv, Ty::F32))?);'#'        let _ = &inv;'#--test mma_emulated"
  "word-wise row copy (rows off 16 bytes, sm_90+): the row's first word not copied#src/emit/cuda.rs#'        for (unsigned o = 0; o < bytes; o += 4) {\n            ((unsigned*)dst)[o / 4]'#'        for (unsigned o = 4; o < bytes; o += 4) {\n            ((unsigned*)dst)[o / 4]'#--test mma_emulated conformance_on"
  "word-wise row copy (rows off 16 bytes, before sm_90): the row's first word not copied#src/emit/cuda.rs#'        for (unsigned o = 0; o < bytes; o += 4) {\n            cp_async_4('#'        for (unsigned o = 4; o < bytes; o += 4) {\n            cp_async_4('#--test mma_emulated conformance_on"
  "merge: a workgroup merges without waiting for the token's others#src/emit/cuda.rs#'            } while (now == gen);'#'            } while (false && now == gen);'#--test mma_emulated"
  "merge: segments dealt by split alone (head blocks take the same ones)#src/kernels/sparse_mla_decode/merge.rs#'split.clone() * head_blocks + workgroup_id(0)'#'split.clone() * head_blocks + u(0)'#--test mma_emulated"
  "pair store helper: the second value lands 4 bytes late#src/emit/cuda.rs#'    *reinterpret_cast<sparse_mla_f32x2*>(p) = v;'#'    p[0] = v.x; p[2] = v.y;'#--test mma_emulated"
  "staged q: rows g + 8 read from row g#src/kir/lower_mma/resident.rs#'let r = add(u(16 * (h / 2) + 8 * (h % 2)), lane_group.clone());'#'let r = add(u(16 * (h / 2)), lane_group.clone());'#--test mma_emulated"
  "staged q in the ring's last stage: staged at its start, the first copies still ahead of it#src/kir/lower_mma/layout.rs#'                    (stages - 1) * stage_words * 4'#'                    0 * stage_words * 4'#--test mma_emulated"
  "softmax: exp_fast computes 2^x, not e^x (the log2 e factor dropped)#src/emit/cuda.rs#'return exp2_fast(x * 1.4426950408889634f);'#'return exp2_fast(x);'#--test mma_emulated"
  "warp groups: every group walks group 0's steps#src/kir/lower_mma/groups.rs#'add(group.clone(), mul(at, u(groups)))'#'mul(at, u(groups))'#--test mma_emulated"
  "index terms: a sum times a constant split into terms that lose the constant#src/emit/cuda.rs#'                    terms(x, k * c, distribute, out)'#'                    terms(x, k, distribute, out)'#--test mma_emulated"
  "f16 scores: the unscale drops E4M3_F16_UNIT (sm_80's widened bytes are the values times 2^-8)#src/kir/lower_mma/resident.rs#'value: mul(inverse, unit),'#'value: inverse,'#--test mma_emulated"
  "softmax: a row masked so far keeps m = MASKED in P's exponent (-m log2 e overflows; both forms)#src/kir/lower_mma/softmax.rs#'select(is_masked(m.clone()), Expr::F32(0.0), m)'#'select(is_masked(m.clone()), m.clone(), m)'#--test online_softmax_emulated --test mma_emulated"
  "e4m3 pairs before sm_89: the low value's 2^8 not put back#src/emit/cuda.rs#'    return v * 256.0f;\n}\nSPARSE_MLA_HELPER float e4m3x2_hi'#'    return v;\n}\nSPARSE_MLA_HELPER float e4m3x2_hi'#--test mma_emulated"
  "ring: no proxy fence after a zeroed row (a later bulk copy over generic stores)#src/kir/lower_mma/ws/producer.rs#'                intr(Intrinsic::FenceProxyAsync),\n            ];'#'            ];'#--test mma_emulated"
  "ring set-up: no proxy fence after the mbarriers' init (a bulk copy completes tx on them)#src/kir/lower_mma/ws.rs#'        body.push(intr(Intrinsic::FenceProxyAsync));\n        body.push(Stmt::Barrier);\n        Ok(body)'#'        body.push(Stmt::Barrier);\n        Ok(body)'#--test mma_emulated"
  "decoded fp8 values: no barrier after the decode (P . V reads a tile still being written)#src/kir/lower_mma/store.rs#'        out.push(barrier);\n        Ok(())'#'        Ok(())'#--test mma_emulated head_groups_over_one_ring"
  "decoded fp8 values: a word's scale group from its word index, not its column#src/kir/lower_mma/store.rs#'let_(group, bin(BinOp::Div, mul(cv.clone(), u(4)), u(per))),'#'let_(group, bin(BinOp::Div, cv.clone(), u(per))),'#--test mma_emulated head_groups_over_one_ring"
  "decoded fp8 values, head groups: the decode strides one group's threads (rows left undecoded)#src/kir/lower_mma/store.rs#'                    total,\n                    intr('#'                    self.w,\n                    intr('#--test mma_emulated head_groups_over_one_ring"
  "resident q: sigma up to 2^126 again (the rope, not in its max, overflows when the latent is 0)#src/kir/lower_mma/resident.rs#'const SIGMA_MAX_FIELD: u32 = 127 + 64;'#'const SIGMA_MAX_FIELD: u32 = 253;'#--test mma_emulated"
  "f16 scores: q's f16 registers in the unpermuted K order#src/kir/lower_mma/resident.rs#'(i * 2 * steps + 2 * kk + reg / 2) * 4 + reg % 2'#'(i * 2 * steps + 2 * kk + reg % 2) * 4 + reg / 2'#--test mma_emulated"
)

results=()
survived=0
checked=0
for m in "${MUTATIONS[@]}"; do
  IFS='#' read -r name file old new tests <<<"$m"
  if [ -n "${MUTATE_ONLY:-}" ] && [[ "$name" != *"$MUTATE_ONLY"* ]]; then continue; fi
  if [ $CHECK = 0 ] && ! git diff --quiet -- "$file"; then
    echo "mutate: $file has local changes; commit or stash first" >&2
    exit 2
  fi
  if ! python3 - "$file" "$old" "$new" "$CHECK" <<'EOF'
import ast, sys
path, old, new = sys.argv[1], ast.literal_eval(sys.argv[2]), ast.literal_eval(sys.argv[3])
check = sys.argv[4] == "1"
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f"mutation text found {s.count(old)} times (want exactly 1) in {path}: {old!r}")
if not check:
    open(path, "w").write(s.replace(old, new, 1))
EOF
  then
    results+=("| $name | $file | - | NOT APPLIED (text not found once) |")
    survived=$((survived + 1))
    continue
  fi
  if [ $CHECK = 1 ]; then
    checked=$((checked + 1))
    continue
  fi
  echo "== mutation: $name ($file)"
  if [ $FULL = 1 ]; then
    tools/test.sh >/tmp/mutate.log 2>&1
  else
    # shellcheck disable=SC2086
    cargo test --release $tests -- --nocapture >/tmp/mutate.log 2>&1
  fi
  rc=$?
  git checkout -q -- "$file"
  if [ $rc -ne 0 ]; then
    why=$(grep -m1 -oE "race|deadlock|FAIL|error\[E[0-9]+\]|panicked|rel_l2 [0-9.e+-]+ lse_err [0-9.e+-]+ [^ ]+ +[0-9.]+ s FAIL" /tmp/mutate.log | head -1)
    results+=("| $name | $file | $tests | killed (${why:-tests failed}) |")
  else
    results+=("| $name | $file | $tests | **survived** |")
    survived=$((survived + 1))
  fi
done
if [ $CHECK = 1 ]; then
  [ ${#results[@]} -gt 0 ] && printf '%s\n' "${results[@]}"
  echo "mutate.sh --check: $checked mutation texts found once, $survived not"
  [ $survived -eq 0 ]
  exit
fi
echo
echo "| mutation | file | tests | result |"
echo "|---|---|---|---|"
printf '%s\n' "${results[@]}"
[ $survived -eq 0 ]
