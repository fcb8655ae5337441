"""The benchmarks run and print what their committed results claim to contain (CPU smoke runs;
the timings themselves are not asserted — benchmarks measure, tests check)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, script: str, *args: str) -> dict:
    """Run ``bench/<script>`` with ``args`` and ``--out``: its printed JSON record, which the
    ``--out`` file must hold too, complete."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--out",
                           str(out)], check=False, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    return printed


def _refused(capsys, script: str, *args: str, exit_code: int | None = None) -> str:
    """``bench/<script>``'s ``main(args)`` run in this process (no interpreter and JAX start-up
    per bad argument; the scripts' good runs stay subprocesses): it must stop with a non-zero
    exit (``exit_code`` exactly, if given: argparse's errors exit 2), and its message — an
    argparse error's stderr or the ``SystemExit`` text, which a subprocess would print to
    stderr — is returned."""
    name = f"_refused_{Path(script).stem}"
    if name not in sys.modules:  # loaded once per process (the scripts import bench/timing.py)
        if str(REPO / "bench") not in sys.path:
            sys.path.insert(0, str(REPO / "bench"))
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        sys.modules[name].main(list(args))
    code = stop.value.code
    assert code not in (0, None), f"{script} {args}: exited {code!r}"
    assert exit_code is None or code == exit_code, f"{script} {args}: exited {code!r}"
    return code if isinstance(code, str) else capsys.readouterr().err


@pytest.mark.slow
def test_train_bench_reports_updates_and_its_kernel_selection(tmp_path):
    printed = _bench(tmp_path, "train.py", "--quick", "--batches", "64", "--repeats", "1",
                     "--skip-epoch", "--skip-collect", "--pallas-kernels", "projection,iqn")
    assert printed["complete"] and printed["pallas_kernels"] == ["iqn", "projection"]
    assert printed["probe"] == ""  # the model's update, no timing probe
    # gpu.toml: online at s, then online + target paired at s′ (float32)
    assert printed["fuse_next_obs"] is False and printed["next_state_twin"] is True
    (row,) = printed["updates"]
    assert row["batch"] == 64 and row["ms_per_update"] > 0
    assert row["samples_per_s"] == pytest.approx(64 * row["updates_per_s"])
    # updates are timed on a replay filled to its capacity (--quick: 100,000), as in training
    assert printed["replay_fill"] == "capacity" and row["replay_size"] == 100_000
    # one seed on one device: "auto" resolves to concurrent graphs, which the CPU has none of
    assert printed["gpu_graphs_resolved"] == "concurrent" and printed["compiler_options"] is None


def _probe_case(impl: str, seed: int):
    """A small network in gpu.toml's layout (online at s, the forwards at s′ apart) with
    ``impl``, a batch of 16 transitions for it, and 8 keys (k[0..2] drew the batch)."""

    import jax
    import jax.numpy as jnp

    from jdqn.config import ModelConfig
    from jdqn.losses import Batch
    from jdqn.networks.model import BranchingQNetwork

    cfg = ModelConfig(width=16, n_grn_blocks=1, n_experts=2, expert_hidden=8, gate_hidden=8,
                      head_hidden=8, n_atoms=11, iqn=True, fuse_next_obs=False, impl=impl)
    k = jax.random.split(jax.random.key(seed), 8)
    b, d = 16, len(cfg.branch_sizes)
    batch = Batch(obs=jax.random.normal(k[0], (b, 12)), next_obs=jax.random.normal(k[1], (b, 12)),
                  action=jax.random.randint(k[2], (b, d), 0, 2), reward=jnp.ones((b,)),
                  discount=jnp.full((b,), 0.9), weight=jnp.ones((b,)))
    return BranchingQNetwork(cfg), batch, k


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_train_bench_probe_drops_the_forwards_at_s_prime(monkeypatch, impl):
    """``--probe no_next_state`` (a timing probe, wrong results): the loss no longer reads the
    target network — the forwards at s′ are gone, through the double-Q kernel (``"pallas"``)
    or not — while the forward at s still sets it; without the probe the target matters. An
    unknown probe is refused by name."""
    import jax

    sys.path.insert(0, str(REPO / "bench"))
    import train as train_bench

    from jdqn.config import TrainConfig
    from jdqn.losses import init_moe_state, total
    from jdqn.networks.model import init_params

    for name in ("next_state_double_q", "next_state_forwards"):  # restored after the test
        monkeypatch.setattr(total, name, getattr(total, name))
    net, batch, k = _probe_case(impl, 0)
    params, t1, t2 = (init_params(net, key, 12) for key in k[3:6])

    def traced():  # a fresh jit: traced again after the probe patches the loss
        return jax.jit(lambda p, t: total.total_loss(p, t, batch, k[6], init_moe_state(2), 0.5,
                                                     net=net, train_cfg=TrainConfig())[0])

    loss = traced()
    assert float(loss(params, t1)) != float(loss(params, t2))
    train_bench.apply_probe("no_next_state")
    loss = traced()
    assert float(loss(params, t1)) == float(loss(params, t2))
    assert float(loss(params, t1)) != float(loss(init_params(net, k[7], 12), t1))
    with pytest.raises(SystemExit, match="--probe must be one of"):
        train_bench.apply_probe("no_forward")


@pytest.mark.parametrize("probe", ["no_backward", "no_backward_grad_free", "no_network",
                                   "no_loss", "no_q_diagnostics", "no_diagnostics"])
def test_train_bench_probes_drop_the_backward_pass_the_loss_or_the_network(monkeypatch, probe):
    """The timing probes that change the train step's ``total_loss`` (replaced for the test
    and restored after). ``no_backward``: the loss keeps its value while its gradient is zero
    (so XLA drops the backward pass); ``no_backward_grad_free`` likewise, with the forward at s
    grad-free (the same function, to rounding); ``no_network``: the loss and every output are
    zeros of their shapes; ``no_q_diagnostics``: the loss and gradient as they were, the Q
    statistics zeros; ``no_diagnostics``: the loss, its terms and gradient as they were, every
    diagnostic and the c51/mse components zeros, the logits flag up; ``no_loss``: the TD and
    IQN terms are stand-ins, so the loss differs, while the gradient still flows through the
    network and the forwards at s′ still count (the loss reads the target network)."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(REPO / "bench"))
    import train as train_bench

    from jdqn.config import TrainConfig
    from jdqn.losses import init_moe_state, total
    from jdqn.networks.model import init_params
    from jdqn.train import epoch as epoch_lib

    monkeypatch.setattr(epoch_lib, "total_loss", epoch_lib.total_loss)
    for name in ("branching_td_loss_batch", "branching_iqn_loss_batch"):
        monkeypatch.setattr(total, name, getattr(total, name))
    monkeypatch.setattr(total, "expected_q", total.expected_q)
    # no_q_diagnostics in gpu.toml's layout: the double-Q kernel selects at s′ from the heads'
    # products
    net, batch, k = _probe_case("pallas" if probe == "no_q_diagnostics" else "xla", 1)
    params, target = init_params(net, k[3], 12), init_params(net, k[4], 12)
    other_target = init_params(net, k[6], 12)

    def value_and_grad(target):  # a fresh jit each call: traced with the loss as patched now
        fn = jax.jit(jax.value_and_grad(
            lambda p, t: epoch_lib.total_loss(p, t, batch, k[5], init_moe_state(2), 0.5,
                                              net=net, train_cfg=TrainConfig()), has_aux=True))
        (loss, aux), grads = fn(params, target)
        return float(loss), aux, grads

    def norm(tree):
        return float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(tree)))

    loss, aux, grads = value_and_grad(target)
    assert norm(grads) > 0 and loss != 0
    train_bench.apply_probe(probe)
    p_loss, p_aux, p_grads = value_and_grad(target)
    assert jax.tree.structure(p_grads) == jax.tree.structure(grads)
    assert jax.tree.structure(p_aux) == jax.tree.structure(aux)
    if probe == "no_backward":
        assert norm(p_grads) == 0.0 and p_loss == loss
    elif probe == "no_backward_grad_free":
        assert norm(p_grads) == 0.0 and p_loss == pytest.approx(loss, rel=1e-5)
    elif probe == "no_network":
        assert norm(p_grads) == 0.0 and p_loss == 0.0 and norm(p_aux) == 0.0
    elif probe == "no_q_diagnostics":  # the loss and gradient as before, the Q statistics 0
        assert p_loss == loss and norm(p_grads) == norm(grads)
        diag, p_diag = aux[3], p_aux[3]
        assert norm(diag["q_mean"]) > 0 and norm(p_diag["q_mean"]) == 0.0
        assert norm(p_diag["q_std"]) == 0.0
    elif probe == "no_diagnostics":
        assert p_loss == loss and norm(p_grads) == norm(grads)
        comps, p_comps, diag, p_diag = aux[0], p_aux[0], aux[3], p_aux[3]
        assert {k for k in comps if float(p_comps[k]) != float(comps[k])} == {"c51", "mse"}
        assert norm(p_comps["c51"]) == norm(p_comps["mse"]) == 0.0
        assert bool(p_diag.pop("logits_finite")) and bool(diag.pop("logits_finite"))
        assert norm(diag) > 0 and norm(p_diag) == 0.0
    else:  # no_loss
        assert norm(p_grads) > 0 and p_loss != pytest.approx(loss, rel=1e-3)
        assert value_and_grad(other_target)[0] != p_loss  # the forwards at s′ still count


def test_profile_summary_counts_each_devices_busy_time_once():
    """Overlapping kernels (concurrent CUDA graphs) count once in the busy time, per device,
    averaged over devices; the summed kernel time counts them all."""
    sys.path.insert(0, str(REPO / "bench"))
    import profile_step

    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/host:CPU"))]
    spans = [(1, 0, 10), (1, 5, 10), (1, 20, 5), (2, 0, 4), (3, 0, 100)]
    events = meta + [{"ph": "X", "name": f"k{i}", "pid": pid, "ts": ts, "dur": dur}
                     for i, (pid, ts, dur) in enumerate(spans)]
    out = profile_step.summarise({"traceEvents": events}, n_updates=2, top=3)
    assert out["device_us_per_update"] == (10 + 10 + 5 + 4) / 2
    assert out["device_busy_us_per_update"] == (20 + 4) / 2 / 2  # device 0: 15 + 5; device 1: 4
    assert out["device_kernels_per_update"] == 2.0


def test_profile_summary_attributes_a_library_kernel_per_hlo_instruction(tmp_path):
    """A cuBLAS kernel that two HLO instructions launch (one name, different ``hlo_op``) gets a
    row per instruction, each attributed to its own scope through the dumped HLO's metadata;
    kernels carry their totals and kinds as before."""
    sys.path.insert(0, str(REPO / "bench"))
    import profile_step

    (tmp_path / "module_0001.jit_updates.sm_9.0_gpu_after_optimizations.txt").write_text(
        '  %custom-call.1 = f32[8,8]{1,0} custom-call(f32[8,8]{1,0} %a), metadata={op_name='
        '"jit(updates)/while/body/jvp(BranchingQNetwork)/iqn/dot_general"}\n'
        '  %custom-call.2 = f32[8,8]{1,0} custom-call(f32[8,8]{1,0} %b), metadata={op_name='
        '"jit(updates)/while/body/transpose(jvp(BranchingQNetwork))/trunk/grn_0/dot_general"}\n')
    gemm = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x256x32"
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    spans = [(gemm, "custom-call.1", 0, 6), (gemm, "custom-call.2", 10, 4),
             (gemm, "custom-call.2", 20, 4), ("loop_add_fusion", "", 30, 2)]
    events = meta + [{"ph": "X", "name": n, "pid": 1, "ts": ts, "dur": dur,
                      "args": {"hlo_op": op} if op else {}} for n, op, ts, dur in spans]
    out = profile_step.summarise({"traceEvents": events}, n_updates=2, top=10,
                                 hlo_dir=str(tmp_path))
    rows = {r["hlo_op"]: r for r in out["top"]}
    assert rows["custom-call.1"]["us_per_update"] == 3.0
    assert rows["custom-call.1"]["op"] == "jvp(BranchingQNetwork)/iqn/dot_general"
    assert rows["custom-call.2"]["calls_per_update"] == 1.0
    assert rows["custom-call.2"]["us_per_update"] == 4.0
    assert out["scopes_us_per_update"]["iqn"] == 3.0
    assert out["scopes_us_per_update"]["bwd grn"] == 4.0
    assert out["kinds_us_per_update"]["gemm"] == 7.0
    assert out["device_kernels_per_update"] == 2.0



_FAKE_BENCH = """
import json, os, sys
import marker  # from the variant's own directory: the harness puts it first on the path
with open(os.environ["AB_ORDER_LOG"], "a") as fh:
    fh.write(marker.NAME + "\\n")
if marker.NAME == "broken":
    sys.exit("boom: this variant fails")
print("a line that is not JSON")
print(json.dumps({"updates": [{"ms_per_update": float(os.environ.get("FAKE_MS", "1.0"))}],
                  "device": "fake device", "jax": "0.0", "argv": sys.argv[1:]}))
"""


def test_ab_harness_alternates_variants_and_writes_every_run_into_one_json(tmp_path):
    """``bench/ab.py`` runs each variant's own script in rounds (A B C A B C), with the variant's
    directory on the import path and its own environment, reads the metric from each run's
    last JSON line, keeps a failing variant's error without stopping, and writes one JSON (the
    same on stdout and in ``--out``) with every run and a per-variant summary."""
    for name in ("a", "b", "broken"):
        d = tmp_path / name
        (d / "bench").mkdir(parents=True)
        (d / "bench" / "fake.py").write_text(_FAKE_BENCH)
        (d / "marker.py").write_text(f"NAME = {name!r}\n")
    order_log, out = tmp_path / "order.log", tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ab.py"), "--variant", f"a={tmp_path / 'a'}",
         "--variant", f"b={tmp_path / 'b'}", "--variant", f"broken={tmp_path / 'broken'}",
         "--env", "b:FAKE_MS=2.5", "--rounds", "2", "--script", "bench/fake.py",
         "--script-args", "--x 1", "--out", str(out), "--", "--y", "2"],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "AB_ORDER_LOG": str(order_log), "FAKE_MS": "1.25"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert order_log.read_text().split() == ["a", "b", "broken"] * 2
    assert [(r["variant"], r["round"]) for r in printed["runs"]] == [
        (v, k) for k in range(2) for v in ("a", "b", "broken")]
    assert printed["summary"]["a"] == {"values": [1.25, 1.25], "best": 1.25, "mean": 1.25}
    assert printed["summary"]["b"]["values"] == [2.5, 2.5]
    assert printed["summary"]["broken"] == {"values": [], "best": None, "mean": None}
    broken = [r for r in printed["runs"] if r["variant"] == "broken"]
    assert all("boom" in r["error"] and r["returncode"] == 1 for r in broken)
    ok = [r for r in printed["runs"] if r["variant"] == "a"]
    assert ok[0]["record"]["argv"] == ["--x", "1", "--y", "2"]
    assert printed["variants"]["b"]["env"] == {"FAKE_MS": "2.5"}
    assert printed["variants"]["a"]["commit"] is None  # a plain directory, not a checkout
    assert printed["device"] == "fake device" and printed["complete"] is True


def test_ab_harness_names_a_commit_only_for_the_top_of_a_checkout(tmp_path):
    """A plain copy unpacked inside another checkout (``git archive … | tar -x -C .ab/base``)
    has no commit of its own: it must not be recorded with the enclosing checkout's commit."""
    spec = importlib.util.spec_from_file_location("ab_bench", REPO / "bench" / "ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    repo, copy = tmp_path / "repo", tmp_path / "repo" / ".ab" / "base"
    copy.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (repo / "f.txt").write_text("1\n")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert ab.git_identity(str(repo)) == {"commit": head, "dirty": False}
    (repo / "f.txt").write_text("2\n")
    assert ab.git_identity(str(repo)) == {"commit": head, "dirty": True}
    assert ab.git_identity(str(copy)) == {"commit": None, "dirty": None}


@pytest.mark.parametrize("args,message", [
    (["--variant", "a"], "expected NAME=DIR"),
    (["--variant", "a=.", "--variant", "a=."], "given twice"),
    (["--variant", "a=/no/such/dir"], "is not a directory"),
    (["--variant", "a=.", "--env", "b:K=V"], "no variant named 'b'"),
    (["--variant", "a=.", "--env", "a:K"], "expected NAME:KEY=VALUE"),
    (["--variant", "a=.", "--script", "bench/none.py"], "bench/none.py not found"),
    (["--variant", "a=.", "--rounds", "0"], "--rounds 0"),
])
def test_ab_harness_refuses_bad_arguments_naming_them(args, message):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "ab.py"), *args],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_checkpoint_bench_times_save_checksums_and_a_verified_restore(tmp_path):
    printed = _bench(tmp_path, "checkpoint.py", "--config",
                     str(REPO / "configs" / "quickstart.toml"), "--set",
                     "train.replay_capacity=2000", "--set", "env.n_envs=16", "--repeats", "1")
    assert printed["replay_capacity"] == 2000 and printed["state_bytes"] > 2000 * 68
    assert printed["checksum_groups"] == 1  # this state's leaves are all small: one pass
    # The replay is filled with random bits, so the files are as large as a trained run's.
    assert printed["checkpoint_disk_bytes"] > 2000 * 68
    for k in ("checksums_device_s", "checksums_host_numpy_s", "save_blocking_s", "save_wait_s",
              "restore_verified_s"):
        assert printed[k] > 0, k


def _kernels_bench(*args: str) -> dict:
    """Run ``bench/kernels.py`` with ``args``: its printed JSON record."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kernels.py"), *args],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_bench_out_file_holds_each_setting_as_it_is_timed(tmp_path, capsys):
    """``bench/kernels.py --out``: after each timed setting the file holds the record's head
    and the rows so far (``complete`` false) — what a run cut short by ``timeout`` leaves —
    and the finished record replaces it, the printed line and the file the same; an --out in
    a missing folder is refused by name."""
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("kernels_bench", REPO / "bench" / "kernels.py")
    kb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kb)
    import jax.numpy as jnp

    out = tmp_path / "k.json"
    kb._OUT.update(path=out, head={"bench": "kernels", "kernel": "probe", "device": "d"})
    seen = []

    def second(x):  # traced after the first row was timed: what the file holds then
        seen.append(json.loads(out.read_text()))
        return x * 2.0

    rows = kb._time_tiles({"first": lambda x: x + 1.0, "second": second}, (jnp.ones(8),), 1,
                          lambda a, a2: {"bitwise_repeat": bool(jnp.array_equal(a, a2))})
    assert seen[0]["complete"] is False and set(seen[0]["rows_so_far"]) == {"first"}
    assert (seen[0]["bench"], seen[0]["kernel"], seen[0]["device"]) == ("kernels", "probe", "d")
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and partial["rows_so_far"] == rows
    assert set(rows) == {"first", "second"} and all(r["us"] > 0 for r in rows.values())
    capsys.readouterr()
    kb._emit({"bench": "kernels", "kernel": "probe", "results": rows})
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text()) and printed["complete"] is True
    assert printed["results"] == rows and "rows_so_far" not in printed
    bad = _refused(capsys, "kernels.py", "--out", str(tmp_path / "none" / "k.json"),
                   exit_code=2)
    assert "its folder" in bad and "does not exist" in bad


def test_kernels_bench_times_the_tree_sum_at_the_updates_bias_shapes():
    out = _kernels_bench("--kernel", "reduce", "--batch", "128", "--reps", "2", "--reduce-tiles",
                         "32/256/4,16/64/4", "--interpret")
    assert out["kernel"] == "reduce" and out["batch"] == 128
    # the twelve bias-gradient shapes, rows scaled to the batch (B·Q rows for the IQN head)
    assert len(out["results"]) == 12 and "128x640" in out["results"]
    assert "1024x256" in out["results"] and "1024x14" in out["results"]
    assert out["interpret"] is True and out["dtype"] == "float32"
    for row in out["results"].values():
        assert set(row) == {"xla_sum", "pallas_r32_c256_w4", "pallas_r16_c64_w4"}
        for name, r in row.items():
            assert r["us"] > 0 and r["bitwise_repeat"], name
            assert r["max_err_over_abs_sum"] < 1e-6, name
            # the kernel (here in the interpreter) is bitwise its tree's jnp reference
            assert r.get("bitwise_reference", True), name
        assert "bitwise_reference" in row["pallas_r16_c64_w4"]


def test_kernels_bench_times_the_grn_tail_against_xla_at_the_pair_shape():
    out = _kernels_bench("--kernel", "grn_tail", "--batch", "40", "--reps", "1", "--grn-tiles",
                         "4/1,16/2", "--interpret")
    assert out["kernel"] == "grn_tail" and out["batch"] == 40 and out["interpret"] is True
    assert out["pair"] == 2 and out["width"] == 256
    assert set(out["results"]) == {"xla_reference", "pallas_rows4_w1", "pallas_rows16_w2"}
    for name, r in out["results"].items():
        assert r["us"] > 0 and r["bitwise_repeat"], name
        assert r["max_abs_diff"] < 1e-5, name
    assert out["results"]["xla_reference"]["max_abs_diff"] == 0.0


def _assert_parity_rows(out: dict, names, tol: float = 1e-5) -> None:
    """Every timed row of a kernels-bench record: a time, a bitwise repeat, and each output's
    relative difference from XLA's reference under ``tol`` (the reference's own row exactly
    0)."""
    for name, r in out["results"].items():
        assert r["us"] > 0 and r["bitwise_repeat"], name
        assert set(r["max_rel_diff"]) == set(names), name
        assert max(r["max_rel_diff"].values()) < tol, name
    assert max(out["results"]["xla_reference"]["max_rel_diff"].values()) == 0.0


def test_kernels_bench_times_the_grn_tail_gradient_against_xla_autodiff():
    out = _kernels_bench("--kernel", "grn_tail_grad", "--batch", "40", "--reps", "1",
                         "--grn-grad-tiles", "8/4,16/2", "--interpret")
    assert out["kernel"] == "grn_tail_grad" and out["batch"] == 40 and out["interpret"] is True
    assert out["width"] == 256
    assert set(out["results"]) == {"xla_reference", "pallas_rows8_w4", "pallas_rows16_w2"}
    _assert_parity_rows(out, ("dy", "db", "dx", "dscale", "doffset"))


@pytest.mark.parametrize("kernel, tiles, names, dtype", [
    ("iqn_tail", ("--iqn-tail-tiles", "16/4,32/2"), ("out",), "float32"),
    ("iqn_tail_grad", ("--iqn-tail-grad-tiles", "16/2/4,32/1/2"), ("dpre", "db1", "dw2", "db2"),
     "bfloat16")])
def test_kernels_bench_times_the_iqn_tail_kernels_against_xla(kernel, tiles, names, dtype):
    out = _kernels_bench("--kernel", kernel, "--batch", "5", "--reps", "1", *tiles, "--interpret",
                         "--dtype", dtype)
    assert out["kernel"] == kernel and out["interpret"] is True and out["dtype"] == dtype
    assert (out["rows"], out["hidden"], out["outputs"]) == (40, 128, 14)  # 5 rows × 8 fractions
    tile_names = [f"pallas_rows{t.split('/')[0]}_" + (
        f"steps{t.split('/')[1]}_w{t.split('/')[2]}" if kernel.endswith("grad")
        else f"w{t.split('/')[1]}") for t in tiles[1].split(",")]
    assert set(out["results"]) == {"xla_reference", *tile_names}
    _assert_parity_rows(out, names, 1e-5 if dtype == "float32" else 1e-2)  # bf16: d pre rounded


def test_kernels_bench_times_the_moe_gate_gradient_against_xla_autodiff():
    out = _kernels_bench("--kernel", "moe_gate_grad", "--batch", "20", "--reps", "1",
                         "--moe-gate-tiles", "16/4,8/2", "--interpret")
    assert out["kernel"] == "moe_gate_grad" and out["batch"] == 20 and out["interpret"] is True
    assert (out["experts"], out["expert_hidden"]) == (8, 64)
    assert set(out["results"]) == {"xla_reference", "pallas_rows16_w4", "pallas_rows8_w2"}
    _assert_parity_rows(out, ("dpre", "db1", "dgate"))


@pytest.mark.parametrize("dtype,pair", [("bfloat16", 1), ("float32", 2)])
def test_kernels_bench_times_the_trunk_input_kernels_against_xla(dtype, pair):
    """Both trunk-input kernels against XLA's kernels for their oracles, at a dtype's shape of
    the forwards at s′ (bf16 apart, float32 the twin pair over one obs): in the interpreter
    the same values as the oracles and bitwise repeatable."""
    out = _kernels_bench("--kernel", "trunk_input", "--batch", "128", "--reps", "1",
                         "--trunk-input-tiles", "64/4", "--dtype", dtype, "--pair", str(pair),
                         "--interpret")
    assert out["kernel"] == "trunk_input" and out["interpret"] is True
    assert (out["dtype"], out["pair"], out["obs_width"], out["width"]) == (dtype, pair, 128, 256)
    assert set(out["results"]) == {"xla_reference", "pallas_rows64_w4"}
    row = out["results"]["pallas_rows64_w4"]
    assert row["us"] > 0 and row["bitwise_repeat"]
    assert max(row["max_abs_diff"].values()) <= (1e-2 if dtype == "bfloat16" else 1e-5), row


def test_kernels_bench_times_the_double_q_kernel_against_xla_at_the_pair_shape():
    out = _kernels_bench("--kernel", "double_q", "--batch", "24", "--reps", "1",
                         "--double-q-tiles", "16/4,4/1", "--interpret")
    assert out["kernel"] == "double_q" and out["batch"] == 24 and out["interpret"] is True
    assert out["pair"] == 2 and out["branch_sizes"] == [4, 3, 3, 3]
    assert set(out["results"]) == {"xla_reference", "pallas_rows16_w4", "pallas_rows4_w1"}
    for name, r in out["results"].items():
        assert r["us"] > 0 and r["bitwise_repeat"], name
        assert r["actions_differing"] == 0 and r["max_abs_diff"] < 1e-5, name
    assert out["results"]["xla_reference"]["max_abs_diff"] == 0.0


def test_kernels_bench_times_the_fused_heads_kernel_against_the_products_path(tmp_path):
    """``--kernel double_q_heads``: the default model's heads at s′ (bf16), the loss's path
    without the kernel against the kernel at two tiles, unrolled and the loop form (in the
    interpreter): no action differs, the same probabilities, each bitwise repeatable; the
    ``--out`` file holds the printed record, complete."""
    out = _kernels_bench("--kernel", "double_q_heads", "--batch", "32", "--reps", "1",
                         "--double-q-heads-tiles", "32/4,16/2/2", "--dtype", "bfloat16",
                         "--interpret", "--out", str(tmp_path / "k.json"))
    assert json.loads((tmp_path / "k.json").read_text()) == out and out["complete"] is True
    assert (out["kernel"], out["batch"], out["dtype"], out["interpret"]) == (
        "double_q_heads", 32, "bfloat16", True)
    assert out["branch_sizes"] == [4, 3, 3, 3] and out["flow_features"] == 8
    assert set(out["results"]) == {"xla_products_double_q", "pallas_rows32_w4",
                                   "pallas_rows16_w2_s2"}
    for name, r in out["results"].items():
        assert r["us"] > 0 and r["bitwise_repeat"], name
        assert r["actions_differing"] == 0 and r["max_abs_diff"] < 1e-5, name


def test_kernels_bench_times_the_mosaic_gpu_heads_kernel_beside_the_path(tmp_path):
    """``--double-q-heads-mgpu``: the Mosaic GPU heads kernel's rows beside the loss's path
    (in JAX's GPU interpreter): a negative ring depth (each branch's actions unrolled), a
    leading ``w`` (the wide layout) with ``g`` (warpgroup semantics) and a probe, each named
    by its settings; the kernel row chooses every action as the path does, and the probe's
    values are wrong by design."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    out = _kernels_bench("--kernel", "double_q_heads", "--batch", "64", "--reps", "1",
                         "--double-q-heads-tiles", "16/2/2",
                         "--double-q-heads-mgpu=-1,wg2:mm_only",  # ("=": a leading minus)
                         "--dtype", "bfloat16", "--interpret", "--head-hidden", "64")
    assert out["hidden"] == 64
    assert set(out["results"]) == {"xla_products_double_q", "pallas_rows16_w2_s2",
                                   "pallas_mgpu_s1_unrolled",
                                   "pallas_mgpu_s2_wide_warpgroup_mm_only"}
    r = out["results"]["pallas_mgpu_s1_unrolled"]
    assert r["bitwise_repeat"] and r["actions_differing"] == 0 and r["max_abs_diff"] < 2e-4
    assert out["results"]["pallas_mgpu_s2_wide_warpgroup_mm_only"]["max_abs_diff"] > 0.01


def test_matmul_floor_collects_every_dot_counting_scans_and_skipping_pallas():
    """``collect_dots`` finds the dots of a differentiated program — forward, backward, inside
    ``scan`` bodies (× length), under ``vmap`` (batch dimensions too), the costlier branch of a
    ``cond`` — and leaves out a Pallas kernel's."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    sys.path.insert(0, str(REPO / "bench"))
    import matmul_floor

    def kernel(a_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], a_ref[...])

    def f(x, w):
        y = x @ w  # [8, 16] @ [16, 16]: one unit of 2·8·16·16 FLOPs
        y = jax.lax.scan(lambda c, _: (c @ w, None), y, None, length=3)[0]
        z = jax.vmap(lambda a: a @ w)(jnp.stack([y, y]))  # one dot, two units
        zb = jax.vmap(lambda a, b: a @ b)(z, jnp.stack([w, w]))  # batch dimension: two units
        c = jax.lax.cond(x[0, 0] > 0, lambda: y @ w @ w, lambda: y @ w)  # one branch runs
        sq = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                            interpret=True)(jax.lax.stop_gradient(w))
        return jnp.sum(zb) + jnp.sum(c) + jnp.sum(sq)

    unit = 2 * 8 * 16 * 16
    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    fwd = matmul_floor.collect_dots(jax.make_jaxpr(f)(x, w).jaxpr)
    assert sum(fwd.values()) == 1 + 3 + 1 + 1 + 2  # the kernel's dot is skipped
    flops = sum(c * matmul_floor.flops_bytes(k)[0] for k, c in fwd.items())
    assert flops == unit * (1 + 3 + 2 + 2 + 2)
    grad = matmul_floor.collect_dots(jax.make_jaxpr(jax.grad(f, argnums=1))(x, w).jaxpr)
    # backward: ∂w of every product and ∂(input) of all but the first (x is not
    # differentiated): 2 · 3 in the scan, 2 + 2 for each vmapped product, 4 in the costlier
    # branch (∂w twice, ∂(y @ w), ∂y)
    grad_flops = sum(c * matmul_floor.flops_bytes(k)[0] for k, c in grad.items())
    assert grad_flops == flops + unit * (1 + 6 + 4 + 4 + 4)


def test_matmul_floor_split_k_is_the_same_product_in_parts():
    """``split_k_fn`` (``--split-k``): the contraction split into S parts, made a batch axis and
    summed, gives the dot's values for the update's weight-gradient forms — a 2-D ``xᵀ·g`` over
    the batch, a batched (grouped) one, a contraction that is not the leading axis, a
    ``preferred_element_type`` — and ``None`` where S does not divide it or there are several
    contracting axes."""
    import numpy as np

    sys.path.insert(0, str(REPO / "bench"))
    import matmul_floor

    keys = [((64, 8), "float32", (64, 12), "float32", (((0,), (0,)), ((), ())), None, None),
            ((3, 32, 5), "float32", (3, 32, 7), "float32", (((1,), (1,)), ((0,), (0,))),
             None, None),
            ((6, 48), "float32", (48, 4), "float32", (((1,), (0,)), ((), ())), None, None),
            ((2, 16, 4), "bfloat16", (2, 16, 8), "bfloat16", (((1,), (1,)), ((0,), (0,))),
             None, "float32")]
    for key in keys:
        a, b = matmul_floor._operands(key)
        want = matmul_floor._dot_fn(key)(a, b)
        for s in (2, 4, 8):
            got = matmul_floor.split_k_fn(key, s)(a, b)
            assert got.shape == want.shape and got.dtype == want.dtype, (key, s)
            np.testing.assert_allclose(np.asarray(got, np.float32),
                                       np.asarray(want, np.float32), rtol=1e-5, atol=1e-4)
    assert matmul_floor.split_k_fn(keys[0], 5) is None  # 5 does not divide 64
    two = ((4, 6, 8), "float32", (6, 8, 3), "float32", (((1, 2), (0, 1)), ((), ())), None, None)
    assert matmul_floor.split_k_fn(two, 2) is None


@pytest.mark.slow
def test_matmul_floor_finds_the_updates_matmuls(tmp_path, capsys):
    """The dots collected from one traced ``train_step`` carry the model's training FLOPs (the
    analytic count of ``train_flops_per_sample``, to 5 %: that count takes the backward as twice
    the forward, including the input layer's ∂obs, which is never computed), and the CPU smoke
    run prints its JSON record."""
    sys.path.insert(0, str(REPO / "bench"))
    import matmul_floor

    from jdqn.config import apply_overrides, config_from_dict, load_config, to_dict
    from jdqn.networks.model import train_flops_per_sample

    cfg = load_config(REPO / "configs" / "gpu.toml",
                      ["data.cache_dir=''", *matmul_floor.quick_sets()])
    cfg = config_from_dict(apply_overrides(to_dict(cfg), ["train.batch_size=64"]))
    dots, p = matmul_floor.update_dots(cfg)
    # every matmul XLA is given: the same count as the lowered program's dot_general ops
    import jax
    import jax.numpy as jnp

    from jdqn.train import epoch as epoch_lib

    _, env_params, state = matmul_floor.train_bench.build(cfg)
    one = jax.tree.map(lambda x: x[0], state)
    hlo = jax.jit(lambda s: epoch_lib.train_step(p.learner, s, env_params,
                                                 jnp.asarray(0, jnp.int32))).lower(one).as_text()
    assert sum(dots.values()) == hlo.count("stablehlo.dot_general")
    # Per transition: the FLOPs that grow with the batch, from 64 to 128 (parameter-sized
    # products — each GRN block's W45·W1, the τ embedding of fractions shared by the batch —
    # do not, and cancel), against the analytic count.
    cfg128 = config_from_dict(apply_overrides(to_dict(cfg), ["train.batch_size=128"]))
    dots128, _ = matmul_floor.update_dots(cfg128)

    def flops(d):
        return sum(c * matmul_floor.flops_bytes(k)[0] for k, c in d.items())

    per_sample = (flops(dots128) - flops(dots)) / 64
    expect = train_flops_per_sample(cfg.model, p.layout.width, len(p.feats.flow_idx))
    assert abs(per_sample / expect - 1) < 0.05, (per_sample, expect)

    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "matmul_floor.py"), "--quick", "--batch", "32",
         "--repeats", "1", "--split-k", "2,3", "--split-min", "600"], check=False,
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batch"] == 32 and out["n_dots_per_update"] == sum(dots.values())
    assert out["isolated_matmul_us_per_update"] == pytest.approx(
        sum(r["count"] * r["us"] for r in out["rows"]), rel=1e-3, abs=1.0)
    # --split-k: only the dots contracting over >= 600 elements get split rows, each split
    # that divides the contraction one (the same product to float32 rounding)
    split = [r for r in out["rows"] if "split_k" in r]
    assert split and all(r["lhs"][0][r["dimension_numbers"][0][0][0]] >= 600 for r in split)
    assert len(split) == sum(
        r["lhs"][0][r["dimension_numbers"][0][0][0]] >= 600 for r in out["rows"]
        if len(r["dimension_numbers"][0][0]) == 1)
    for r in split:
        k = r["lhs"][0][r["dimension_numbers"][0][0][0]]
        assert set(r["split_k"]) == {str(s) for s in (2, 3) if k % s == 0}, r
        assert all(v["us"] > 0 and v["max_rel_diff"] < 1e-5 for v in r["split_k"].values()), r
    bad = _refused(capsys, "matmul_floor.py", "--quick", "--split-k", "4,1")
    assert "--split-k '4,1': each split must be at least 2" in bad


def test_xla_flags_sweep_keeps_failures_and_brackets_the_base(tmp_path, monkeypatch, capsys):
    """``bench/xla_flags.py`` runs the base first and last around the settings, divides by the
    best base, keeps a setting that failed with its return code and output, and refuses a
    setting that is not an XLA flag."""
    sys.path.insert(0, str(REPO / "bench"))
    import xla_flags

    seen = []

    def fake_run(flags, args):
        seen.append(flags)
        if flags == "--xla_bad=1":
            return {"flags": flags, "rc": 1, "wall_s": 0.1, "log_tail": "Unknown flag"}
        ms = {"": 4.0 if len(seen) == 1 else 3.5, "--xla_good=1": 3.0}[flags]
        return {"flags": flags, "rc": 0, "wall_s": 0.1, "ms_per_update": ms}

    monkeypatch.setattr(xla_flags, "run_setting", fake_run)
    out_file = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["xla_flags.py", "--flag=--xla_good=1",
                                      "--flag=--xla_bad=1", "--out", str(out_file)])
    xla_flags.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen == ["", "--xla_good=1", "--xla_bad=1", ""]
    assert out == json.loads(out_file.read_text()) and out["complete"]
    assert out["base_ms"] == [3.5, 4.0]
    good, bad = out["runs"][1], out["runs"][2]
    assert good["vs_base_best"] == pytest.approx(3.0 / 3.5, abs=1e-4)
    assert bad["rc"] == 1 and bad["log_tail"] == "Unknown flag" and "vs_base_best" not in bad

    # the real subprocess: an unknown flag stops XLA at start-up, and the row says so
    args = xla_flags.argparse.Namespace(config=str(REPO / "configs" / "gpu.toml"),
                                        dtype="float32", batch=64, updates=1, repeats=1,
                                        sets=[], quick=True, timeout=300)
    monkeypatch.undo()
    row = xla_flags.run_setting("--xla_no_such_flag=1", args)
    assert row["rc"] != 0 and "ms_per_update" not in row
    assert "--xla_no_such_flag" in row["log_tail"]

    proc = subprocess.run([sys.executable, str(REPO / "bench" / "xla_flags.py"),
                           "--flag=--not_xla=1"], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "'--not_xla=1' is not an XLA flag" in proc.stderr


def test_backtest_bench_compares_chunk_lengths_on_the_same_records(tmp_path):
    printed = _bench(tmp_path, "backtest.py", "--config",
                     str(REPO / "configs" / "quickstart.toml"), "--set",
                     "data.synthetic.n_bars=6000", "--chunks", "64,0", "--repeats", "1")
    assert printed["same_records"] is True
    chunked, whole = printed["rows"]
    assert chunked["chunk"] == 64 and whole["chunk"] == 0
    # The validation and test windows differ in length: one program chunked, two whole.
    assert chunked["validation_steps"] != chunked["test_steps"]
    assert chunked["programs_compiled"] == 1 and whole["programs_compiled"] == 2
    for row in printed["rows"]:
        for k in ("validation_first_call_s", "validation_s", "test_first_call_s", "test_s"):
            assert row[k] > 0, k


@pytest.mark.slow
def test_replay_bench_times_sampling_and_both_priority_updates(tmp_path, capsys):
    printed = _bench(tmp_path, "replay.py", "--capacity", "5000", "--batch", "256", "--reps", "3")
    assert printed["capacity"] == 5000 and printed["batch"] == 256
    assert set(printed["us"]) == {"sample", "update_sorting", "update_sorted",
                                  "sample_and_update", "n_sampleable", "sums_xla", "sums_pallas",
                                  "sample_pallas", "sample_and_update_pallas"}
    assert all(v > 0 for v in printed["us"].values())
    # the kernel (in the interpreter here) against XLA's sums: float32 rounding apart
    assert printed["impls"] == ["xla", "pallas"]
    assert printed["parity"]["sums_max_rel_diff"] < 1e-5
    assert printed["parity"]["sampled_slots_equal"] > 0.99
    one = _bench(tmp_path, "replay.py", "--capacity", "600", "--batch", "16", "--reps", "1",
                 "--impls", "pallas", "--warps", "2", "--profile", "1")
    assert one["us"]["sums_pallas_warps2"] > 0 and "parity" not in one
    assert set(one["profile"]) == {"pallas"}  # (no device kernels on the CPU: a host trace)
    assert set(one["profile"]["pallas"]) == {"device_busy_us_per_call", "kernels_per_call", "top"}
    assert "--impls 'cuda'" in _refused(capsys, "replay.py", "--impls", "cuda", exit_code=2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_row_independence_check_passes_the_network_and_catches_a_coupled_one(impl,
                                                                             monkeypatch):
    """``bench/row_independence.py`` (run on the GPU for the compiled kernels): on CPU, with
    XLA's ops or the Pallas kernels (interpreted), row 0's decision, aux and Q do not move when
    the other rows change; a policy that mixes in the batch mean (what a cross-row kernel bug
    would do: a later window's bars reaching an earlier window's decision) is caught."""
    import dataclasses

    from helpers import tiny_config

    spec = importlib.util.spec_from_file_location("row_bench", REPO / "bench" /
                                                  "row_independence.py")
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, impl=impl))
    assert rb.check(cfg, 16) == {"rows": 16, "row0_unchanged": True, "others_changed": True}
    honest = rb.greedy_policy
    monkeypatch.setattr(rb, "greedy_policy",
                        lambda learner, p, o: honest(learner, p, o + o.mean(0)))
    # (the Q read beside it stays honest; the coupled action and aux must be caught)
    assert rb.check(cfg, 16)["row0_unchanged"] is False


def test_fused_grn_bench_kernel_is_the_models_grn_block(tmp_path):
    """bench/fused_grn.py's whole-block kernel (Pallas' interpreter) and its XLA path compute
    what GRNBlock computes with the same parameters, float32 and bf16; the script runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jdqn.networks.trunk import GRNBlock

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("fused_grn", REPO / "bench" / "fused_grn.py")
    fg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fg)
    h, m = 32, 48
    x = jax.random.normal(jax.random.key(1), (m, h))
    for dtype, tol in (("float32", 2e-5), ("bfloat16", 0.05)):
        block = GRNBlock(width=h, matmul_dtype=dtype, impl="xla", grad_free=True)
        params = block.init(jax.random.key(0), x)["params"]
        params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2),
                                                                     p.shape), params)
        want = np.asarray(block.apply({"params": params}, x).astype(jnp.float32))
        w = params["fc"]["kernel"] @ params["glu"]["kernel"]
        b = params["fc"]["bias"] @ params["glu"]["kernel"] + params["glu"]["bias"]
        xd = x.astype(dtype)
        args = (xd, params["fc_elu"]["kernel"], params["fc_elu"]["bias"], w, b,
                params["norm"]["scale"], params["norm"]["bias"])
        got = fg.fused(*args, rows=16, warps=4, chunk=16, stages=2, interpret=True)
        ref = fg.xla_path(*args, interpret=True)
        for out in (got, ref):
            np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=tol,
                                       rtol=tol, err_msg=dtype)
    out = _bench(tmp_path, "fused_grn.py", "--batch", "32",
                 "--width", "32", "--tiles", "16/4/16/2", "--interpret")
    assert out["interpret"] and set(out["results"]) == {"xla", "fused_r16_w4_c16_s2"}
    assert out["results"]["fused_r16_w4_c16_s2"]["max_abs_diff"] < 0.05


def test_fused_grn_bench_takes_a_grn_blocks_own_inputs_in_the_model(tmp_path, capsys):
    """``--inputs model``: block 1's input is block 0's output on block 0's input (the XLA
    path, to bf16 rounding), each parameter set its own initialisation, the weights folded as
    the network folds them; the script runs on them and names them; a third block is
    refused."""
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("fused_grn", REPO / "bench" / "fused_grn.py")
    fg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fg)
    b0 = fg.model_args(64, 64, 2, "bfloat16", 0)
    b1 = fg.model_args(64, 64, 2, "bfloat16", 1)
    for a in (b0, b1):
        assert [v.shape for v in a] == [(2, 64), (2, 64, 64), (2, 64, 64), (2, 64, 128),
                                        (2, 128), (2, 64), (2, 64)]
        assert a[1].dtype == jnp.bfloat16
        assert np.abs(np.asarray(a[2][0] - a[2][1])).max() > 0.01  # two initialisations
    for i in range(2):
        b_fc, x, w_fc, *rest = (v[i] for v in b0)
        out = np.asarray(fg.xla_path(x, w_fc, b_fc, *rest).astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(b1[1][i].astype(jnp.float32)), out, atol=0.07,
                                   rtol=0.02)
    assert np.abs(np.asarray(b0[1].astype(jnp.float32) - b1[1].astype(jnp.float32))).max() > 0.1
    one = fg.model_args(64, 64, 0, "bfloat16", 1)
    np.testing.assert_array_equal(np.asarray(one[1].astype(jnp.float32)),
                                  np.asarray(b1[1][0].astype(jnp.float32)))
    out = _bench(tmp_path, "fused_grn.py", "--batch", "64", "--width", "64", "--tiles", "",
                 "--inputs", "model", "--block", "1", "--pair", "0")
    assert out["inputs"] == "model block 1" and set(out["results"]) == {"xla"}
    assert 0.5 < out["x_std"] < 2
    bad = _refused(capsys, "fused_grn.py", "--inputs", "model", "--block", "2", "--tiles", "",
                   "--batch", "64", "--width", "64")
    assert "--block 2: the model has GRN blocks 0 and 1" in bad
    # block 0's parameters with block 1's input (scaled): the diagnosis of a value-dependent
    # time pairs each block's parameters with the other's input
    swap = fg.model_args(64, 64, 2, "bfloat16", 0, x_block=1, x_scale=0.5)
    for j, v in enumerate(swap):
        if j != 1:
            np.testing.assert_array_equal(np.asarray(v), np.asarray(b0[j]))
    np.testing.assert_array_equal(np.asarray(swap[1].astype(jnp.float32)),
                                  np.asarray(b1[1].astype(jnp.float32)) * 0.5)
    out = _bench(tmp_path, "fused_grn.py", "--batch", "64", "--width", "64", "--tiles", "",
                 "--inputs", "model", "--block", "0", "--x-block", "1", "--x-scale", "2",
                 "--pair", "0")
    assert (out["inputs"], out["x_block"], out["x_scale"]) == ("model block 0", 1, 2.0)
    assert out["x_std"] == pytest.approx(2.0, rel=0.25)  # block 1's LayerNorm'd input × 2
    for flags, msg in ((("--x-block", "3"), "--x-block 3: the model has GRN blocks 0 and 1"),
                       (("--x-scale", "0"), "--x-scale 0.0: must be a positive finite")):
        bad = _refused(capsys, "fused_grn.py", "--inputs", "model", *flags, "--tiles", "",
                       "--batch", "64", "--width", "64")
        assert msg in bad, bad


def _grn_block_sets(h: int = 128, m: int = 128):
    """bench/fused_grn_mgpu.py as a module, two parameter sets and inputs of GRNBlock (bf16)
    in the kernels' argument order (each and stacked), what the model's GPU block computes for
    each, and a check against that (a changed rounding, epsilon or normalisation moves
    percents of the elements)."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jdqn.networks.trunk import GRNBlock

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("fused_grn_mgpu",
                                                  REPO / "bench" / "fused_grn_mgpu.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    block = GRNBlock(width=h, matmul_dtype="bfloat16", impl="pallas", grad_free=True)
    sets, want = [], []
    for seed in (0, 3):  # two parameter sets and inputs: the kernel must pick each set's own
        x = jax.random.normal(jax.random.key(seed + 7), (m, h)).astype(jnp.bfloat16)
        params = block.init(jax.random.key(seed), x)["params"]
        noise = jax.random.key(seed + 2)
        params = jax.tree.map(lambda p, k=noise: p + 0.1 * jax.random.normal(k, p.shape),
                              params)
        want.append(np.asarray(block.apply({"params": params}, x).astype(jnp.float32)))
        w = params["fc"]["kernel"] @ params["glu"]["kernel"]
        b = params["fc"]["bias"] @ params["glu"]["kernel"] + params["glu"]["bias"]
        sets.append((x, params["fc_elu"]["kernel"], params["fc_elu"]["bias"], w, b,
                     params["norm"]["scale"], params["norm"]["bias"]))
    assert np.abs(want[0] - want[1]).max() > 0.5
    stacked = [jnp.stack(a) for a in zip(*sets)]

    def assert_model(got, i, what, frac=1e-3):
        got = np.asarray(got.astype(jnp.float32))
        assert np.abs(got - want[i]).max() <= 1 / 32, what
        assert np.mean(got != want[i]) <= frac, what

    return fm, sets, stacked, assert_model


def test_fused_grn_mosaic_gpu_kernel_is_the_models_grn_block(tmp_path, capsys):
    """bench/fused_grn_mgpu.py's wgmma kernel (JAX's GPU interpreter, η through shared memory)
    computes what GRNBlock computes on the GPU (the grad-free block with its tail kernel,
    ``impl = "pallas"``) in bf16, bit for bit but for rare last-bit differences, for two
    parameter sets and inputs at once and pipelines of depth 1 and 2; the timing probes each
    drop something; the bench runs it beside XLA's path and refuses bad settings."""
    import jax.numpy as jnp
    import numpy as np

    from jdqn.pallas import grn_tail

    fm, sets, stacked, assert_model = _grn_block_sets()

    for stages, stages2 in ((1, 1), (2, 2), (2, 1)):
        got = fm.fused(*stacked, eps=grn_tail.EPSILON, stages=stages, stages2=stages2,
                       eta_in="smem", interpret=True)
        for i in range(2):
            assert_model(got[i], i, f"stages={stages}/{stages2} set {i}")
    one = fm.fused_one(*sets[1], eps=grn_tail.EPSILON, eta_in="smem", interpret=True)
    assert_model(one, 1, "one set")
    bad = {"bf16 only": {"dtype": jnp.float32}, "does not tile": {"tm": 96},
           "go by 64": {"c2": 32}, "probe must be": {"probe": "fast"},
           "eta_in must be": {"eta_in": "reg"}, "GPU only": {"eta_in": "regs"},
           "1 deep or more": {"stages": 0}}
    for message, kw in bad.items():
        dtype = kw.pop("dtype", jnp.bfloat16)
        args = [stacked[0].astype(dtype), *stacked[1:]]
        with pytest.raises(ValueError, match=message):
            fm.fused(*args, eps=1e-3, **{"eta_in": "smem", **kw}, interpret=True)
    # the timing probes drop work: each changes the values, and each something different
    dropped = {}
    for probe in ("", "no_act", "no_ln", "mm_only"):
        dropped[probe] = np.asarray(fm.fused_one(*sets[0], eps=grn_tail.EPSILON, probe=probe,
                                                 eta_in="smem", interpret=True)
                                    .astype(jnp.float32))
    for p, q in itertools.combinations(dropped, 2):
        assert np.abs(dropped[p] - dropped[q]).max() > 0.1, (p, q)
    out = _bench(tmp_path, "fused_grn.py", "--batch", "128", "--width", "128", "--tiles", "",
                 "--mgpu-tiles", "64/64/2/smem,64/64/1/smem/2/no_ln", "--interpret",
                 "--reps", "1")
    assert set(out["results"]) == {"xla", "mgpu_tm64_c64_s2_smem",
                                   "mgpu_tm64_c64_s1-2_smem_probe_no_ln"}
    assert out["results"]["mgpu_tm64_c64_s2_smem"]["max_abs_diff"] <= 1 / 32
    assert out["results"]["mgpu_tm64_c64_s2_smem"]["frac_diff"] <= 1e-3
    assert out["results"]["mgpu_tm64_c64_s1-2_smem_probe_no_ln"]["max_abs_diff"] > 0.1
    for tiles, message in (("64/64", "is not tm/c2"), ("64/x/2/regs", "c2 = 'x'"),
                           ("64/64/0/regs", "stages = '0'"), ("64/64/2/reg", "eta_in = 'reg'"),
                           ("64/64/2/regs/2/no-ln", "probe = 'no-ln'")):
        bad = _refused(capsys, "fused_grn.py", "--mgpu-tiles", tiles)
        assert message in bad, (tiles, bad[-500:])
    bad = _refused(capsys, "fused_grn.py", "--mgpu-tiles", "64/64/2/regs", "--dtype", "float32")
    assert "--mgpu-tiles: the Mosaic GPU kernel runs bf16 only" in bad


def test_fused_grn_mosaic_gpu_kernel_with_s_in_registers_is_the_models_grn_block(tmp_path,
                                                                                  capsys):
    """bench/fused_grn_mgpu.py's ``fused_rs`` (s in registers, rings through one aliased
    buffer; JAX's GPU interpreter) computes what GRNBlock computes on the GPU, for two
    parameter sets at once, at widths of two and four column blocks and with rings of one
    slot (every refill waits for the wgmma before it), two, three and one per step; the
    probes each drop something; the bench runs it and refuses bad settings."""
    import numpy as np

    from jdqn.pallas import grn_tail

    fm, _, stacked, assert_model = _grn_block_sets()
    for stages, stages2 in ((1, 1), (2, 3), (3, 4)):  # h = 128: 2 W_fc chunks, 4 W steps
        got = fm.fused_rs(*stacked, eps=grn_tail.EPSILON, stages=stages, stages2=stages2,
                          interpret=True)
        for i in range(2):
            assert_model(got[i], i, f"stages={stages}/{stages2} set {i}")
    fm, _, stacked, assert_model = _grn_block_sets(h=256, m=64)  # 4 chunks, 16 W steps
    got = fm.fused_rs(*stacked, eps=grn_tail.EPSILON, stages=2, stages2=3, interpret=True)
    for i in range(2):  # the LayerNorm's sums over four column blocks, not one row: their
        # float32 order moves a few more last bits (0.18 %; a changed rounding moves percents)
        assert_model(got[i], i, f"h=256 set {i}", frac=5e-3)
    bad = {"bf16 or float32, not float16": {"dtype": "float16"}, "does not tile": {"rows": 32},
           "probe must be": {"probe": "fast"}, "1 slot or more": {"stages2": 0}}
    for message, kw in bad.items():
        x = stacked[0].astype(kw.pop("dtype", stacked[0].dtype))[:, :kw.pop("rows", 64)]
        with pytest.raises(ValueError, match=message):
            fm.fused_rs(x, *stacked[1:], eps=1e-3, **kw, interpret=True)
    dropped = {probe: np.asarray(fm.fused_rs(*(a[:1] for a in stacked), eps=grn_tail.EPSILON,
                                             probe=probe, interpret=True)[0].astype("float32"))
               for probe in ("", "no_act", "no_ln", "mm_only")}
    for p, q in itertools.combinations(dropped, 2):
        assert np.abs(dropped[p] - dropped[q]).max() > 0.1, (p, q)
    out = _bench(tmp_path, "fused_grn.py", "--batch", "64", "--width", "128", "--tiles", "",
                 "--mgpu-rs", "2/3,1/2/no_ln+approx+wg", "--interpret", "--reps", "1")
    assert set(out["results"]) == {"xla", "mgpu_rs_s2-3", "mgpu_rs_s1-2_probe_no_ln_approx_wg"}
    assert out["results"]["mgpu_rs_s2-3"]["frac_diff"] <= 1e-3
    assert out["results"]["mgpu_rs_s1-2_probe_no_ln_approx_wg"]["max_abs_diff"] > 0.1
    for flags, message in ((["--mgpu-rs", "2"], "is not stages/stages2"),
                           (["--mgpu-rs", "2/0"], "stages2 = '0'"),
                           (["--mgpu-rs", "2/3/fast"], "options 'fast'"),
                           (["--mgpu-rs", "2/3/wg+lane"], "options 'wg+lane'"),
                           (["--mgpu-rs", "2/3/no_ln+no_act"], "options 'no_ln+no_act'")):
        bad = _refused(capsys, "fused_grn.py", *flags)
        assert message in bad, (flags, bad[-500:])


def test_fused_grn_bench_runs_the_products_kernel_in_float32(tmp_path):
    """``--mgpu-rs`` under ``--dtype float32``: the product's kernel as TF32 on the GPU (in the
    interpreter with exact products), each setting equal to the XLA path to float32 rounding,
    a probe changing the values (``--mgpu-tiles``, the bf16-only research kernel, is still
    refused for float32: the Mosaic GPU kernel test above)."""
    out = _bench(tmp_path, "fused_grn.py", "--batch", "64", "--width", "64", "--tiles", "",
                 "--dtype", "float32", "--mgpu-rs", "1/3/approx,2/3,1/1/no_ln",
                 "--interpret", "--reps", "1")
    res = out["results"]
    assert set(res) == {"xla", "mgpu_rs_s1-3_approx", "mgpu_rs_s2-3", "mgpu_rs_s1-1_probe_no_ln"}
    assert out["dtype"] == "float32"
    for name in ("mgpu_rs_s1-3_approx", "mgpu_rs_s2-3"):
        assert res[name]["max_abs_diff"] <= 1e-5 and res[name]["bitwise_repeat"], name
    assert res["mgpu_rs_s1-1_probe_no_ln"]["max_abs_diff"] > 0.1


def test_trace_neighbours_shows_each_launch_with_the_idle_gap_before_it(tmp_path):
    """bench/trace_neighbours.py on a trace with a host process, two device streams and two
    launches of the kernel asked for: the gap is measured from the previous device kernel's end
    (negative where they overlap), host events are not device kernels, and a folder without a
    trace is refused by name."""
    import gzip
    import json

    spec = importlib.util.spec_from_file_location("trace_neighbours",
                                                  REPO / "bench" / "trace_neighbours.py")
    tn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tn)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kern = [("gemm", 7, 0.0, 10.0), ("grn_block_kernel", 7, 30.0, 40.0),
            ("grn_block_kernel", 7, 71.0, 25.0), ("tail", 8, 90.0, 3.0)]
    ev = meta + [{"ph": "X", "pid": 1, "tid": t, "name": n, "ts": ts, "dur": d,
                  "args": {"hlo_op": f"op{k}", "correlation_id": str(k)}}
                 for k, (n, t, ts, d) in enumerate(kern)]
    ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "grn_block_kernel launch", "ts": 20.0,
               "dur": 1.0})
    lines = tn.report({"traceEvents": ev})
    assert lines[0] == "device events 4 streams [(1, 7), (1, 8)]"
    first, second = (lines.index("----", i) for i in (0, lines.index("----") + 1))
    assert lines[first + 2].startswith(">> tid=7 ts=30.0 dur=40.0 gap=20.0 grn_block_kernel op1")
    assert lines[second + 3].startswith(">> tid=7 ts=71.0 dur=25.0 gap=1.0 grn_block_kernel op2")
    assert "gap=-6.0 tail op3" in lines[second + 4]  # starts 6 µs before the kernel ends
    assert json.loads(lines[-1]) == {"hlo_op": "op1", "correlation_id": "1"}
    assert tn.report({"traceEvents": ev}, "moe")[-1] == "no device kernel named like 'moe'"
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "t.trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": ev}, fh)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "trace_neighbours.py"),
                          str(tmp_path), "gemm"], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert ">> tid=7 ts=0.0 dur=10.0 gap=0.0 gemm op0" in out
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "trace_neighbours.py"),
                          str(tmp_path / "plugins" / "none")], check=False, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "no Perfetto trace (*.json.gz) under it" in bad.stderr


def test_timed_loop_can_rewrite_a_buffer_before_each_call_and_fused_grn_times_it(tmp_path,
                                                                                capsys):
    """bench/timing.py's loop with ``evict_bytes``: a float32 buffer of that size, rewritten
    whole behind a barrier and chained into each call's input, the calls' results unchanged;
    without it the loop has no such buffer. fused_grn --evict-l2-mb reports the cold time and
    the rewrite's own, and refuses a negative size."""
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(REPO / "bench"))
    import timing

    fn = lambda a, b: jnp.tanh(a * b)
    args = (jnp.linspace(0.0, 1.0, 8), jnp.full((8,), 2.0))
    warm, cold = (timing.timed_loop(fn, 3, e) for e in (0, 2**20))
    np.testing.assert_array_equal(np.asarray(warm(*args)), np.asarray(cold(*args)))
    want = sum(float(jnp.sum(fn(args[0] + 1e-3 * i, args[1]))) for i in range(3))
    np.testing.assert_allclose(float(warm(*args)), want, rtol=1e-6)
    hlo_cold = cold.lower(*args).as_text()
    assert "262144" in hlo_cold and "optimization_barrier" in hlo_cold
    assert "262144" not in warm.lower(*args).as_text()
    out = _bench(tmp_path, "fused_grn.py", "--batch", "64", "--width", "64", "--tiles", "",
                 "--pair", "0", "--reps", "2", "--evict-l2-mb", "1")
    assert out["evict_mb"] == 1.0 and out["evict_us"] > 0
    assert {"us", "us_cold"} <= set(out["results"]["xla"])
    bad = _refused(capsys, "fused_grn.py", "--tiles", "", "--evict-l2-mb", "-1")
    assert "--evict-l2-mb -1.0: must be a finite number >= 0" in bad
