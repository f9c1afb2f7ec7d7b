#!/usr/bin/env python3
"""Probe: can NCCL Zero-CTA (copy-engine) collectives, NCCL symmetric windows, or a torch
symmetric-memory copy-engine all-gather/reduce-scatter cut the matmul slowdown caused by
collectives running beside it, eagerly and under CUDA graph capture?

Run (2 x H200, one node):  torchrun --standalone --nproc-per-node 2 .probe/zero_cta_probe.py

Self-contained: it does not import the package. For each variant it prints, per collective
(bf16 all-gather, 64 MiB output; fp32 sum reduce-scatter, 128 MiB input):
  * the CUDA activity one call launches (NCCL kernel vs memcpy = copy engine), from torch.profiler;
  * eager: time per collective alone, and an 8192^3 bf16 matmul loop alone vs. with the
    collective looping beside it on a side stream (slowdown %);
  * graph: capture once (capture_error_mode="thread_local"), replay, compare bitwise with the
    eager result; then the same timings with the graph replayed beside the matmuls.
Variants (each guarded; a failure is printed and the probe moves on):
  nccl_default            world process group, plain buffers (the baseline)
  symm_cuda_ce            torch symmetric memory, CUDA backend: peer cudaMemcpyAsync (copy_) into the
                          peer's buffer + signal-pad barriers; RS = push + local add (one SM kernel)
  nccl_symm_win           new group, default CTA policy, buffers from a MemPool registered with
                          register_mem_pool(pool, symm=True) (NCCL symmetric windows -> SymK kernels)
  nccl_zero_plain         new group with config.cta_policy = NCCL_CTA_POLICY_ZERO, plain buffers
  nccl_zero_symm_win      same zero-CTA group, symmetric-window buffers (AG should use the copy engine)
  nccl_zero_symm_win_max4 zero-CTA + config.max_ctas=4, symmetric windows (RS SymK kernel <= 4 CTAs)
Env knobs: PROBE_VARIANTS=a,b  PROBE_N_MM=20  PROBE_DEADLINE_S=170  PROBE_ALL_RANKS=1
           PROBE_NCCL_DEBUG=1 (NCCL INFO log for INIT,ENV,TUNING to /tmp/zero_cta_probe_nccl.<host>.<pid>.log)
"""

import os

# Must be set before torch.distributed (and NCCL) is imported / initialised.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["TORCH_SYMMMEM_IMPLICIT_POOL"] = "0"  # symm_mem.empty -> plain empty_strided_p2p (no MemPool)
_REMOVED_ENV = {}
for _k in ("NCCL_CTA_POLICY",):  # would override every communicator's config, baseline included
    if _k in os.environ:
        _REMOVED_ENV[_k] = os.environ.pop(_k)
if os.environ.get("PROBE_NCCL_DEBUG") == "1":
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,ENV,TUNING")
    os.environ.setdefault("NCCL_DEBUG_FILE", "/tmp/zero_cta_probe_nccl.%h.%p.log")

import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL = int(os.environ.get("LOCAL_RANK", "0"))
ALL_RANKS = os.environ.get("PROBE_ALL_RANKS") == "1"
N_MM = int(os.environ.get("PROBE_N_MM", "20"))
DEADLINE_S = float(os.environ.get("PROBE_DEADLINE_S", "170"))
MM_N = 8192
AG_OUT_BYTES = 64 << 20  # bf16 all-gather output
RS_IN_BYTES = 128 << 20  # fp32 reduce-scatter input
BARRIER_TIMEOUT_MS = 20000
STAGE = ["start"]
RESULTS = []  # rows for the summary
T0 = time.time()


def log(msg, all_ranks=False):
    if RANK == 0 or ALL_RANKS or all_ranks:
        print(f"[r{RANK} {time.time() - T0:6.1f}s] {msg}", flush=True)


def err(what, e):
    print(f"[r{RANK} {time.time() - T0:6.1f}s] ERROR in {what}: {type(e).__name__}: {e}", flush=True)
    tb = traceback.format_exc().strip().splitlines()
    for line in tb[-6:]:
        print(f"[r{RANK}]     {line}", flush=True)


def _watchdog():
    time.sleep(DEADLINE_S)
    print(f"[r{RANK}] WATCHDOG: {DEADLINE_S:.0f}s deadline hit during stage '{STAGE[0]}' (hang?); exiting", flush=True)
    sys.stdout.flush()
    os._exit(3)


threading.Thread(target=_watchdog, daemon=True).start()


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
class Ctx:
    pass


C = Ctx()


def sync_all():
    torch.cuda.synchronize()
    dist.barrier(group=C.gloo)


def wait_gpu(what, timeout_s=30.0):
    """torch.cuda.synchronize() with a deadline: a collective that never completes (a hang) is
    reported by name and the probe exits, instead of waiting for the global watchdog."""
    evs = []
    for s in (torch.cuda.current_stream(), C.cs, C.ss, C.cap):
        e = torch.cuda.Event()
        e.record(s)
        evs.append(e)
    t_end = time.time() + timeout_s
    while not all(e.query() for e in evs):
        if time.time() > t_end:
            print(f"[r{RANK}] HANG: GPU work of '{what}' not done after {timeout_s:.0f}s; exiting", flush=True)
            os._exit(4)
        time.sleep(0.005)
    torch.cuda.synchronize()


def driver_version():
    try:
        import ctypes

        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


def agree(ok):
    """True only if every rank says ok (over gloo, so it never queues GPU work)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=C.gloo)
    return bool(t.item())


def agree_max(v):
    t = torch.tensor([int(v)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=C.gloo)
    return int(t.item())


def gen(seed, n, dtype):
    g = torch.Generator(device=C.dev)
    g.manual_seed(seed)
    return torch.randn(n, generator=g, device=C.dev, dtype=torch.float32).to(dtype)


def mm():
    torch.matmul(C.A, C.B, out=C.Cm)


def measure(coll_fn, coll_iters, mm_iters):
    """Queue mm_iters matmuls on the compute stream and coll_iters collectives on the side stream,
    both held behind a _sleep gate so everything is queued before the GPU starts. Returns
    (ms per matmul, ms per collective, host enqueue ms)."""
    sync_all()
    gate = torch.cuda.Event()
    with torch.cuda.stream(C.cs):
        torch.cuda._sleep(C.sleep_cycles)
        gate.record()
    t_host = time.perf_counter()
    mm_ev = coll_ev = None
    if mm_iters:
        with torch.cuda.stream(C.cs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(mm_iters):
                mm()
            b.record()
            mm_ev = (a, b)
    if coll_iters:
        C.ss.wait_event(gate)
        with torch.cuda.stream(C.ss):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(coll_iters):
                coll_fn()
            b.record()
            coll_ev = (a, b)
    host_ms = (time.perf_counter() - t_host) * 1e3
    torch.cuda.synchronize()
    mm_ms = mm_ev[0].elapsed_time(mm_ev[1]) / mm_iters if mm_ev else float("nan")
    coll_ms = coll_ev[0].elapsed_time(coll_ev[1]) / coll_iters if coll_ev else float("nan")
    return mm_ms, coll_ms, host_ms


def timing_block(vname, op, mode, coll_fn, nbytes):
    """Alone and concurrent timings for one collective (eager call or graph replay)."""
    STAGE[0] = f"{vname}/{op}/{mode}/timing"
    _, coll_alone, host = measure(coll_fn, 30, 0)
    mm_alone, _, _ = measure(None, 0, N_MM)
    n_coll = math.ceil(N_MM * mm_alone / max(coll_alone, 1e-3) * 1.05)
    n_coll = agree_max(min(max(n_coll, 5), 1500))
    mm_conc, coll_conc, host_c = measure(coll_fn, n_coll, N_MM)
    cover = n_coll * coll_conc / (N_MM * mm_conc)
    slow_mm = (mm_conc / mm_alone - 1) * 100
    slow_c = (coll_conc / coll_alone - 1) * 100
    gbps = nbytes / (coll_alone * 1e-3) / 1e9
    warn = ""
    if host_c > C.sleep_ms * 0.9:
        warn += f" [gate too short: host enqueue {host_c:.0f} ms > sleep {C.sleep_ms:.0f} ms]"
    if cover < 0.9:
        warn += " [collectives covered <90% of the matmul loop: slowdown understated]"
    log(
        f"{vname:24s} {op} {mode:5s} coll alone {coll_alone * 1e3:8.1f} us ({gbps:6.1f} GB/s of {nbytes >> 20} MiB) | "
        f"with matmuls {coll_conc * 1e3:8.1f} us ({slow_c:+6.1f}%) | matmul {mm_alone:.3f} -> {mm_conc:.3f} ms "
        f"({slow_mm:+5.1f}%) | n_coll {n_coll} cover {cover:.2f}{warn}"
    )
    RESULTS.append((vname, op, mode, coll_alone * 1e3, coll_conc * 1e3, mm_alone, mm_conc, slow_mm, cover))


def cuda_activity(fn):
    """Names of the GPU activities (kernels, memcpys) one call launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync_all()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(C.ss):
            fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if "CUDA" in str(getattr(e, "device_type", "")) and e.name not in names:
            names.append(e.name)
    return names


# ----------------------------------------------------------------------------------------------
# variants
# ----------------------------------------------------------------------------------------------
class Variant:
    name = "?"

    def setup(self):
        raise NotImplementedError

    def ag(self):
        raise NotImplementedError

    def rs(self):
        raise NotImplementedError

    def outputs(self):
        return {"ag": self.ag_out, "rs": self.rs_out}

    def fill_inputs(self):
        self.ag_in.copy_(C.ag_in_src)
        self.rs_in.copy_(C.rs_in_src)


def _alloc_buffers(v):
    v.ag_in = torch.empty(C.ag_shard, dtype=torch.bfloat16, device=C.dev)
    v.ag_out = torch.empty(C.ag_shard * WORLD, dtype=torch.bfloat16, device=C.dev)
    v.rs_in = torch.empty(C.rs_chunk * WORLD, dtype=torch.float32, device=C.dev)
    v.rs_out = torch.empty(C.rs_chunk, dtype=torch.float32, device=C.dev)


class NcclVariant(Variant):
    def __init__(self, name, pg_factory, symm_window):
        self.name = name
        self.pg_factory = pg_factory
        self.symm_window = symm_window
        self.pool = None

    def setup(self):
        self.pg = self.pg_factory()
        if self.symm_window:
            backend = self.pg._get_backend(C.dev)
            self.pool = torch.cuda.MemPool(backend.mem_allocator)  # ncclMemAlloc-backed segments
            try:  # register first: the allocator hook then registers segments in allocation order
                backend.register_mem_pool(self.pool, symm=True)  # ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)
            except TypeError:
                backend.register_mem_pool(self.pool, True)
            with torch.cuda.use_mem_pool(self.pool):
                _alloc_buffers(self)
        else:
            _alloc_buffers(self)
        self.fill_inputs()
        torch.cuda.synchronize()

    def ag(self):
        dist.all_gather_into_tensor(self.ag_out, self.ag_in, group=self.pg)

    def rs(self):
        dist.reduce_scatter_tensor(self.rs_out, self.rs_in, op=dist.ReduceOp.SUM, group=self.pg)


class SymmCudaCE(Variant):
    """torch symmetric memory (CUDA backend): push my shard into every peer's output buffer with
    copy_ (cudaMemcpyAsync, copy engine), bracketed by signal-pad barriers (1 block, 32 threads)."""

    name = "symm_cuda_ce"

    def setup(self):
        import torch.distributed._symmetric_memory as symm_mem

        gname = dist.group.WORLD.group_name
        try:
            symm_mem.set_backend("CUDA")
        except Exception as e:  # noqa: BLE001
            err("symm_mem.set_backend('CUDA') (continuing with the default backend)", e)
        try:
            symm_mem.enable_symm_mem_for_group(gname)  # needed by older torch; harmless later
        except Exception:  # noqa: BLE001
            pass
        try:
            log(f"symm_mem backend: {symm_mem.get_backend(C.dev)}")
        except Exception:  # noqa: BLE001
            pass
        W, r, shard, chunk = WORLD, RANK, C.ag_shard, C.rs_chunk
        self.ag_in = torch.empty(shard, dtype=torch.bfloat16, device=C.dev)
        self.ag_out = symm_mem.empty(shard * W, dtype=torch.bfloat16, device=C.dev)
        self.ag_h = symm_mem.rendezvous(self.ag_out, gname)
        self.rs_in = torch.empty(chunk * W, dtype=torch.float32, device=C.dev)
        self.rs_out = torch.empty(chunk, dtype=torch.float32, device=C.dev)
        self.rs_stage = symm_mem.empty(chunk * W, dtype=torch.float32, device=C.dev)  # slot s: from rank s
        self.rs_h = symm_mem.rendezvous(self.rs_stage, gname)
        order = [(r + k) % W for k in range(1, W)] + [r]  # peers first, own chunk last
        self.ag_dsts = [self.ag_h.get_buffer(p, (shard,), torch.bfloat16, r * shard) for p in order]
        self.rs_push = [
            (self.rs_h.get_buffer(p, (chunk,), torch.float32, r * chunk), self.rs_in[p * chunk : (p + 1) * chunk])
            for p in order
            if p != r
        ]
        self.rs_own = self.rs_in[r * chunk : (r + 1) * chunk]
        self.rs_slots = [self.rs_stage[s * chunk : (s + 1) * chunk] for s in range(W) if s != r]
        self.fill_inputs()
        torch.cuda.synchronize()

    def ag(self):
        self.ag_h.barrier(0, BARRIER_TIMEOUT_MS)  # every peer is done with its previous contents
        for dst in self.ag_dsts:
            dst.copy_(self.ag_in)  # same dtype, contiguous -> cudaMemcpyAsync D2D (peer over NVLink)
        self.ag_h.barrier(1, BARRIER_TIMEOUT_MS)  # every peer's pushes into my buffer have landed

    def rs(self):
        self.rs_h.barrier(0, BARRIER_TIMEOUT_MS)
        for dst, src in self.rs_push:
            dst.copy_(src)
        self.rs_h.barrier(1, BARRIER_TIMEOUT_MS)
        if len(self.rs_slots) == 1:  # 2 ranks: a + b, bitwise what NCCL's sum gives
            torch.add(self.rs_own, self.rs_slots[0], out=self.rs_out)
        else:  # more ranks: the summation order differs from NCCL's (not bitwise comparable)
            self.rs_out.copy_(self.rs_own)
            for s in self.rs_slots:
                self.rs_out.add_(s)


# ----------------------------------------------------------------------------------------------
# process groups
# ----------------------------------------------------------------------------------------------
_PGS = {}


def _zero_policy_value():
    P = dist.ProcessGroupNCCL
    if hasattr(P, "NCCL_CTA_POLICY_ZERO"):
        return P.NCCL_CTA_POLICY_ZERO
    log("dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO missing; using the raw value 2")
    return 2


def make_pg(key, cta_zero=False, max_ctas=None):
    if key in _PGS:
        return _PGS[key]
    opts = dist.ProcessGroupNCCL.Options()
    if cta_zero:
        if not hasattr(opts.config, "cta_policy"):
            raise RuntimeError("ProcessGroupNCCL.Options().config has no cta_policy in this torch build")
        opts.config.cta_policy = _zero_policy_value()
    if max_ctas is not None:
        opts.config.max_ctas = max_ctas
    pg = dist.new_group(ranks=list(range(WORLD)), backend="nccl", pg_options=opts)
    t = torch.ones(1, device=C.dev)
    with torch.cuda.stream(C.ss):
        dist.all_reduce(t, group=pg)  # the communicator must exist before register_mem_pool
    torch.cuda.synchronize()
    _PGS[key] = pg
    return pg


# ----------------------------------------------------------------------------------------------
# per-variant run
# ----------------------------------------------------------------------------------------------
def run_variant(v):
    vname = v.name
    STAGE[0] = f"{vname}/setup"
    ok = True
    try:
        v.setup()
    except Exception as e:  # noqa: BLE001
        err(f"{vname} setup", e)
        ok = False
    if not agree(ok):
        log(f"{vname}: setup failed on some rank; skipped")
        return
    for op, nbytes, expected in (("ag", AG_OUT_BYTES, C.ag_expected), ("rs", RS_IN_BYTES, C.rs_expected)):
        fn = v.ag if op == "ag" else v.rs
        out = v.outputs()[op]
        # 1) eager warm-up (lazy NCCL/CE init happens here, never inside a capture) + correctness
        STAGE[0] = f"{vname}/{op}/eager"
        ok = True
        try:
            with torch.cuda.stream(C.ss):
                fn()
                fn()
            wait_gpu(f"{vname} {op} eager")
            eq = torch.equal(out, expected)
            ndiff = int((out != expected).sum().item()) if not eq else 0
            eq_base = None
            if C.baseline.get(op) is not None:
                eq_base = torch.equal(out, C.baseline[op])
            log(
                f"{vname:24s} {op} eager result: bitwise == analytic expected: {eq}"
                + (f" ({ndiff} elements differ)" if not eq else "")
                + (f"; == nccl_default eager: {eq_base}" if eq_base is not None else "")
            )
            if vname == "nccl_default":
                C.baseline[op] = out.clone()
            eager_ref = out.clone()
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} eager", e)
            ok = False
        if not agree(ok):
            log(f"{vname} {op}: eager run failed on some rank; skipping this collective")
            continue
        # 2) what the GPU runs for one call (NCCL kernel => SMs; memcpy only => copy engine)
        STAGE[0] = f"{vname}/{op}/profile"
        ok = True
        try:
            names = cuda_activity(fn)
            nccl_k = [n for n in names if "nccl" in n.lower()]
            cp = [n for n in names if "memcpy" in n.lower()]
            other = [n for n in names if n not in nccl_k and n not in cp]
            log(
                f"{vname:24s} {op} GPU activity: nccl kernels={[n[:70] for n in nccl_k]} memcpy={cp[:3]} "
                f"other kernels={[n[:50] for n in other][:4]}"
            )
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} profile", e)
            ok = False
        agree(ok)
        # 3) eager timings
        ok = True
        try:
            timing_block(vname, op, "eager", fn, nbytes)
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} eager timing", e)
            ok = False
        if not agree(ok):
            continue
        # 4) CUDA graph: capture once, replay, compare bitwise with the eager result
        STAGE[0] = f"{vname}/{op}/capture"
        ok = True
        g = None
        try:
            sync_all()
            g = torch.cuda.CUDAGraph()
            gc.disable()
            try:
                with torch.cuda.graph(g, stream=C.cap, capture_error_mode="thread_local"):
                    fn()
            finally:
                gc.enable()
            torch.cuda.synchronize()
            C.graphs.append(g)  # keep alive: destroying graphs that hold NCCL resources can hang
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} graph capture", e)
            ok = False
        if not agree(ok):
            log(f"{vname:24s} {op} graph: CAPTURE FAILED")
            RESULTS.append((vname, op, "graph", "capture failed"))
            continue
        STAGE[0] = f"{vname}/{op}/replay"
        ok = True
        try:
            out.fill_(float("nan") if out.is_floating_point() else 0)
            sync_all()
            with torch.cuda.stream(C.ss):
                g.replay()
            wait_gpu(f"{vname} {op} graph replay")
            eq1 = torch.equal(out, eager_ref)
            out.fill_(float("nan"))
            sync_all()
            with torch.cuda.stream(C.ss):
                for _ in range(3):
                    g.replay()
            wait_gpu(f"{vname} {op} graph replays")
            eq3 = torch.equal(out, eager_ref)
            log(f"{vname:24s} {op} graph: captured OK; replay bitwise == eager: {eq1} (after 3 more replays: {eq3})")
            RESULTS.append((vname, op, "graph-eq", eq1 and eq3))
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} graph replay", e)
            ok = False
        if not agree(ok):
            continue
        ok = True
        try:
            timing_block(vname, op, "graph", g.replay, nbytes)
        except Exception as e:  # noqa: BLE001
            err(f"{vname} {op} graph timing", e)
            ok = False
        agree(ok)


# ----------------------------------------------------------------------------------------------
def main():
    assert torch.cuda.is_available(), "needs CUDA"
    torch.cuda.set_device(LOCAL)
    C.dev = torch.device("cuda", LOCAL)
    C.baseline = {}
    C.graphs = []
    STAGE[0] = "init_process_group"
    dist.init_process_group("nccl", device_id=C.dev, timeout=datetime.timedelta(seconds=90))
    C.gloo = dist.new_group(backend="gloo")
    C.cs, C.ss, C.cap = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    # (a) versions and API presence
    P = dist.ProcessGroupNCCL
    try:
        cfg_fields = [f for f in ("cta_policy", "max_ctas", "min_ctas", "nvls_ctas") if hasattr(P.Options().config, f)]
    except Exception as e:  # noqa: BLE001
        cfg_fields = f"error {e}"
    log(f"torch {torch.__version__} cuda {torch.version.cuda} | "
        f"torch.cuda.nccl.version() = {torch.cuda.nccl.version()}")
    log(
        f"device {torch.cuda.get_device_name(C.dev)} | world {WORLD} | CUDA driver API {driver_version()} "
        "(NCCL 2.28's non-NVLS copy-engine sync writes peer flags with stream write-value ops, which CUDA >= 13.1 "
        "no longer allows on remote memory: NVIDIA/nccl#2052)"
    )
    log(
        f"API: ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO={getattr(P, 'NCCL_CTA_POLICY_ZERO', 'MISSING')} "
        f"Options().config fields={cfg_fields} register_mem_pool={hasattr(P, 'register_mem_pool')} "
        f"mem_allocator={hasattr(P, 'mem_allocator')}"
    )
    env_keys = (
        "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_CUMEM_ENABLE", "NCCL_WIN_ENABLE",
        "NCCL_SYM_CTAS", "NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_ALGO", "NCCL_PROTO",
        "TORCH_SYMMMEM", "NCCL_GRAPH_REGISTER",
    )
    log("env: " + " ".join(f"{k}={os.environ[k]}" for k in env_keys if k in os.environ))
    if _REMOVED_ENV:
        log(f"removed from env for this probe (it overrides every communicator): {_REMOVED_ENV}")
    if WORLD != 2:
        log(f"WARNING: written for 2 ranks (world={WORLD}); the reduce-scatter bitwise checks assume 2")

    # inputs and analytic expectations (same on every rank: generated from per-rank seeds)
    STAGE[0] = "inputs"
    C.ag_shard = AG_OUT_BYTES // 2 // WORLD
    C.rs_chunk = RS_IN_BYTES // 4 // WORLD
    C.ag_in_src = gen(1000 + RANK, C.ag_shard, torch.bfloat16)
    C.ag_expected = torch.cat([gen(1000 + r, C.ag_shard, torch.bfloat16) for r in range(WORLD)])
    C.rs_in_src = gen(2000 + RANK, C.rs_chunk * WORLD, torch.float32)
    sl = slice(RANK * C.rs_chunk, (RANK + 1) * C.rs_chunk)
    acc = gen(2000, C.rs_chunk * WORLD, torch.float32)[sl].clone()
    for r in range(1, WORLD):
        acc = acc + gen(2000 + r, C.rs_chunk * WORLD, torch.float32)[sl]
    C.rs_expected = acc
    torch.manual_seed(0)
    C.A = torch.randn(MM_N, MM_N, device=C.dev, dtype=torch.bfloat16)
    C.B = torch.randn(MM_N, MM_N, device=C.dev, dtype=torch.bfloat16)
    C.Cm = torch.empty(MM_N, MM_N, device=C.dev, dtype=torch.bfloat16)
    for _ in range(3):
        mm()
    # calibrate torch.cuda._sleep (cycles per ms) for the start gate
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    torch.cuda.synchronize()
    cyc_per_ms = 20_000_000 / max(a.elapsed_time(b), 1e-3)
    C.sleep_ms = 60.0
    C.sleep_cycles = int(cyc_per_ms * C.sleep_ms)
    log(f"matmul {MM_N}^3 bf16 x {N_MM} per loop; start gate {C.sleep_ms:.0f} ms ({cyc_per_ms / 1e3:.0f} Mcycles/s)")
    sync_all()

    variants = [
        NcclVariant("nccl_default", lambda: dist.group.WORLD, symm_window=False),
        SymmCudaCE(),
        NcclVariant("nccl_symm_win", lambda: make_pg("default_symm"), symm_window=True),
        NcclVariant("nccl_zero_plain", lambda: make_pg("zero", cta_zero=True), symm_window=False),
        NcclVariant("nccl_zero_symm_win", lambda: make_pg("zero", cta_zero=True), symm_window=True),
        NcclVariant("nccl_zero_symm_win_max4", lambda: make_pg("zero_max4", cta_zero=True, max_ctas=4), True),
    ]
    wanted = os.environ.get("PROBE_VARIANTS")
    if wanted:
        keep = {w.strip() for w in wanted.split(",")}
        variants = [v for v in variants if v.name in keep or v.name == "nccl_default"]
    for v in variants:
        log(f"=== variant {v.name} ===")
        try:
            run_variant(v)
        except Exception as e:  # noqa: BLE001  (an exception that escaped the guarded steps)
            err(f"{v.name} (unguarded)", e)
            if not agree(False):
                log(f"{v.name}: aborted")

    # summary
    STAGE[0] = "summary"
    log("=== summary (rank 0; us per collective, matmul ms per 8192^3) ===")
    for row in RESULTS:
        if len(row) == 9:
            vname, op, mode, ca, cc, ma, mc, sm, cover = row
            log(
                f"  {vname:24s} {op} {mode:5s} coll {ca:8.1f} -> {cc:8.1f} us | "
                f"matmul {ma:.3f} -> {mc:.3f} ms ({sm:+5.1f}%) cover {cover:.2f}"
            )
        else:
            log(f"  {row[0]:24s} {row[1]} {row[2]}: {row[3]}")
    log(f"done in {time.time() - T0:.0f}s; exiting without process-group teardown (graphs hold NCCL resources)")
    sys.stdout.flush()
    try:
        sync_all()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001
        err(f"main (stage {STAGE[0]})", e)
        sys.stdout.flush()
        os._exit(1)
