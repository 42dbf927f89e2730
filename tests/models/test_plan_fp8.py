"""FP8 training in the step-time model, the planner and the dry run: the blocks' linears run at the FP8 peak while
attention and the LM head stay 16-bit (checked against GEMM seconds recomputed here from the FLOP counts), the
quantisation passes and FP8 all-gathers are what the module says, the saved linear inputs take half the memory (and
the FP8 weight copies the trainer keeps are added), a GPU without FP8 is refused naming the argument, and
`megakernels plan --precision fp8` ranks and prints fp8 layouts that `megakernels train` accepts."""

from __future__ import annotations

import json

import pytest

from megakernels_models.arguments import ArgumentError, validate
from megakernels_models.cli import main, parse_train_args
from megakernels_models.models.config import preset
from megakernels_models.planning import costs, plan, reproduce

H200, A100 = costs.DEVICES["h200"], costs.DEVICES["a100"]


@pytest.fixture(scope="module")
def llama():
    return costs.MetaModel(preset("llama3-8b"))


def _layout(**kw) -> costs.Layout:
    base = dict(dp=8, micro_batch_size=1, global_batch_size=64, distributed_optimizer=True)
    return costs.Layout(**{**base, **kw})


def test_the_blocks_linears_run_at_the_fp8_peak_and_attention_and_the_head_stay_16_bit(llama):
    cfg = llama.config
    h, q, kv, f, layers, vocab, s = 4096, 4096, 1024, 14336, 32, 128256, 8192
    assert (cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.ffn_hidden_size) == (h, q, kv, f)
    # forward FLOPs per token, counted here: QKV, output projection, SwiGLU's three matrices; the attention core
    # (QK^T and PV over s keys); the LM head
    linears = 2.0 * layers * (h * (q + 2 * kv) + q * h + 3 * h * f)
    attention = 4.0 * s * q * layers
    head = 2.0 * h * vocab
    tokens_per_device = 64 * s / 8
    # H200's efficiency: a large GEMM's measured 80 % of the peak (MAMF) x the 0.72 a training step keeps of it;
    # hidden 4096 and 8192 tokens a GEMM are past both shape penalties
    eff = 0.80 * 0.72
    bf16 = costs.predict(llama, _layout(precision="bf16"), H200)
    fp8 = costs.predict(llama, _layout(precision="fp8"), H200)
    assert bf16["gemm_s"] == pytest.approx(3 * (linears + attention + head) * tokens_per_device / (989e12 * eff))
    assert bf16["gemm_fp8_s"] == 0.0 and bf16["quantize_s"] == 0.0
    # fp8: forward, data and weight gradients of the linears at 1979 TFLOP/s × eff × FP8_GEMM_RELATIVE
    assert fp8["gemm_fp8_s"] == pytest.approx(
        3 * linears * tokens_per_device / (1979e12 * eff * costs.FP8_GEMM_RELATIVE)
    )
    assert fp8["gemm_16_s"] == pytest.approx(3 * (attention + head) * tokens_per_device / (989e12 * eff))
    # the GEMM time of the linears scales with the peak ratio; attention and the head do not move
    linear_bf16 = bf16["gemm_s"] - fp8["gemm_16_s"]
    assert linear_bf16 / fp8["gemm_fp8_s"] == pytest.approx(1979 / 989 * costs.FP8_GEMM_RELATIVE)
    # a bounded speedup: more than 1, less than the GEMMs alone would give (quantisation is added)
    speedup = bf16["step_s"] / fp8["step_s"]
    assert 1.2 < speedup < bf16["gemm_s"] / fp8["gemm_s"] < 2.0
    # MFU is still counted against the 16-bit peak
    assert fp8["mfu"] == pytest.approx(bf16["mfu"] * speedup)


def test_full_recomputation_repeats_the_fp8_forward_and_the_router_stays_16_bit():
    llama = preset("llama3-8b")
    forward = llama.forward_flops_per_token()["layers_gemm"]
    assert costs.fp8_flops_per_token(llama, "none") == pytest.approx(3 * forward)
    assert costs.fp8_flops_per_token(llama, "selective") == pytest.approx(3 * forward)
    assert costs.fp8_flops_per_token(llama, "full") == pytest.approx(4 * forward)
    mixtral = preset("mixtral-8x7b")
    router = 2.0 * mixtral.hidden_size * mixtral.num_experts * mixtral.num_layers  # every layer a MoE layer
    expected = 3 * (mixtral.forward_flops_per_token()["layers_gemm"] - router)
    assert costs.fp8_flops_per_token(mixtral) == pytest.approx(expected)


def test_quantisation_is_one_memory_bound_pass_per_linear_input_weight_and_output_gradient(llama):
    h, q, kv, f, layers, s = 4096, 4096, 1024, 14336, 32, 8192
    # forward: the inputs of QKV (h), output projection (q), gate/up (h) and down (f), and the four weights;
    # backward: the gradients of their outputs (q + 2kv, h, 2f, h)
    forward = s * (h + q + h + f) + h * (q + 2 * kv) + q * h + 3 * h * f
    backward = s * ((q + 2 * kv) + h + 2 * f + h)
    bandwidth = 4800e9 * 0.8
    micro_batches = 64 // 8
    for recipe, bytes_per_element in (("tensorwise", 2 + 2 + 1 + 1), ("blockwise", 2 + 1 + 1)):
        got = costs.predict(llama, _layout(precision="fp8", fp8_recipe=recipe), H200)
        expected = (forward + backward) * bytes_per_element * layers * micro_batches / bandwidth
        assert got["quantize_s"] == pytest.approx(expected)
        full = costs.predict(llama, _layout(precision="fp8", fp8_recipe=recipe, recompute="full"), H200)
        recomputed = (2 * forward + backward) * bytes_per_element * layers * micro_batches / bandwidth
        assert full["quantize_s"] == pytest.approx(recomputed)


def test_blockwise_scaling_trades_slower_gemms_for_a_cheaper_quantisation(llama):
    tensorwise = costs.predict(llama, _layout(precision="fp8"), H200)
    blockwise = costs.predict(llama, _layout(precision="fp8", fp8_recipe="blockwise"), H200)
    assert blockwise["gemm_fp8_s"] == pytest.approx(tensorwise["gemm_fp8_s"] / costs.FP8_BLOCKWISE_GEMM)
    assert blockwise["quantize_s"] == pytest.approx(tensorwise["quantize_s"] * 4 / 6)
    assert blockwise["gemm_16_s"] == tensorwise["gemm_16_s"]
    assert tensorwise["step_s"] < blockwise["step_s"]  # at these shapes the GEMMs weigh more than the passes


@pytest.mark.parametrize("tp,sp,recipe", [(1, False, "tensorwise"), (2, True, "tensorwise"), (2, True, "blockwise")])
def test_the_saved_linear_inputs_take_one_byte_an_element_and_the_fp8_weights_are_kept(llama, tp, sp, recipe):
    h, q, kv, f, layers, s, mbs = 4096, 4096, 1024, 14336, 32, 8192, 2
    kw = dict(tp=tp, dp=8 // tp, sequence_parallel=sp, micro_batch_size=mbs, global_batch_size=64)
    bf16 = costs.memory(llama, _layout(**kw))
    fp8 = costs.memory(llama, _layout(precision="fp8", fp8_recipe=recipe, **kw))
    # QKV's and the MLP's inputs (h each, replicated: divided by tp with SP; with the blockwise recipe under SP
    # the trainer keeps their 16-bit shards), the output projection's (q) and the down projection's (f) inputs,
    # split over tp: each element 1 byte instead of 2
    column = 0 if recipe == "blockwise" and sp else 2 * h / (tp if sp else 1)
    saved = mbs * s * (column + (q + f) / tp)
    # and every layer keeps its weights' transposed FP8 copies (1 byte a weight of the device) for backward
    weights = (h * (q + 2 * kv) + q * h + 3 * h * f) / tp
    # per layer, one micro-batch in flight (no pipeline)
    assert bf16["breakdown"]["activations"] - fp8["breakdown"]["activations"] == pytest.approx(
        (saved - weights) * layers
    )
    for part in ("weights", "grads", "optimizer"):  # bf16 weights, fp32 gradients and master state, as in bf16
        assert fp8["breakdown"][part] == bf16["breakdown"][part]
    full = dict(kw, recompute="full")  # full recomputation keeps only each layer's input: nothing changes
    fp8_full, bf16_full = costs.memory(llama, _layout(precision="fp8", **full)), costs.memory(llama, _layout(**full))
    assert fp8_full["total"] == bf16_full["total"]


def test_under_sequence_parallelism_the_forward_all_gathers_move_fp8(llama):
    kw = dict(tp=4, dp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=16)
    act = 8192 * 4096 * 2  # one micro-batch's [s, b, h] in bf16
    half_ring = 3 / 4 * act / (H200.intra_gbps * 1e9)  # one all-gather or reduce-scatter over 4 ranks
    micro_batches, layers = 16 // 2, 32
    for recompute, forwards in (("none", 1), ("full", 2)):
        bf16 = costs.predict(llama, _layout(recompute=recompute, **kw), H200)["tp_s"]
        fp8 = costs.predict(llama, _layout(precision="fp8", recompute=recompute, **kw), H200)["tp_s"]
        # each forward (and its recomputation) has two all-gathers, at half the bytes in FP8
        assert bf16 - fp8 == pytest.approx(micro_batches * layers * forwards * 2 * half_ring / 2)
    no_sp = dict(kw, sequence_parallel=False)  # all-reduces of the 16-bit outputs: nothing changes
    assert costs.predict(llama, _layout(precision="fp8", **no_sp), H200)["tp_s"] == pytest.approx(
        costs.predict(llama, _layout(**no_sp), H200)["tp_s"]
    )


def test_a_gpu_without_fp8_is_refused_naming_the_precision(llama, capsys):
    with pytest.raises(ValueError, match=r"--precision fp8 .*A100"):
        costs.predict(llama, _layout(precision="fp8"), A100)
    with pytest.raises(ValueError, match="--precision fp8"):
        plan.rank(preset("gpt-tiny"), 8, 64, A100, precision="fp8")
    assert main(["plan", "--preset", "llama3-8b", "--gpus", "8", "--gpu", "a100", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--precision fp8" in err and "A100" in err and "Traceback" not in err
    from megakernels_models.planning.dryrun import report

    argv = ["--preset", "llama3-8b", "--dry-run", "--nproc", "8", "--micro-batch-size", "1", "--precision", "fp8"]
    with pytest.raises(ArgumentError, match=r"--precision fp8 .*--gpu a100"):
        report(parse_train_args([*argv, "--gpu", "a100"]), out=lambda line: None)
    assert main(["train", *argv, "--gpu", "v100"]) == 2
    err = capsys.readouterr().err
    assert "--precision fp8" in err and "V100" in err and "Traceback" not in err
    row = {**_PUBLISHED_ROW, "gpu": "a100", "precision": "fp8"}
    with pytest.raises(reproduce.ReproduceError, match="column 'precision'.*A100"):
        reproduce.parse_row(row)


_PUBLISHED_ROW = {
    "model": "llama",
    "num_layers": "32",
    "hidden": "4096",
    "heads": "32",
    "num_kv_heads": "8",
    "ffn_hidden": "14336",
    "vocab": "128256",
    "seq_len": "8192",
    "gpu": "h100",
    "num_gpus": "8",
    "tp": "1",
    "pp": "1",
    "global_batch": "8",
    "micro_batch": "1",
    "published_metric": "tokens_per_s_per_gpu",
    "published_value": "7000",
}


def test_published_runs_in_fp8_go_through_the_fp8_model():
    run = reproduce.parse_row({**_PUBLISHED_ROW, "precision": "fp8", "fp8_recipe": "blockwise"})
    assert (run.layout.precision, run.layout.fp8_recipe) == ("fp8", "blockwise")
    bf16 = reproduce.predict_run(reproduce.parse_row(_PUBLISHED_ROW))
    fp8 = reproduce.predict_run(reproduce.parse_row({**_PUBLISHED_ROW, "precision": "fp8"}))
    assert fp8["prediction"]["gemm_fp8_s"] > 0 and fp8["predicted"] > bf16["predicted"]
    with pytest.raises(reproduce.ReproduceError, match="column 'fp8_recipe'.*needs precision fp8"):
        reproduce.parse_row({**_PUBLISHED_ROW, "fp8_recipe": "blockwise"})


def test_bad_precisions_and_recipes_name_the_argument(capsys):
    with pytest.raises(ValueError, match="precision must be one of"):
        costs.Layout(precision="fp4")
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        costs.Layout(precision="fp8", fp8_recipe="rowwise")
    argv = ["plan", "--preset", "gpt-tiny", "--gpus", "2", "--fp8-recipe", "blockwise"]
    assert main(argv) == 2
    assert "--fp8-recipe blockwise needs --precision fp8" in capsys.readouterr().err


def test_plan_ranks_fp8_layouts_and_its_json_carries_the_precision(capsys):
    argv = ["plan", "--preset", "llama3-8b", "--gpus", "8", "--top", "3", "--json"]
    assert main([*argv, "--precision", "fp8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp8" and out["fp8_recipe"] == "tensorwise"
    for row in out["ranking"]:
        assert row["layout"]["precision"] == "fp8" and row["layout"]["fp8_recipe"] == "tensorwise"
        assert "--precision fp8" in row["command"] and "--fp8-recipe" not in row["command"]
        split = row["compute_split_s"]
        assert split["gemm_fp8_s"] > 0 and split["quantize_s"] > 0
        assert sum(split.values()) == pytest.approx(row["time_split_s"]["compute_s"])
    assert main([*argv, "--precision", "fp8", "--fp8-recipe", "blockwise"]) == 0
    blockwise = json.loads(capsys.readouterr().out)
    assert all(r["layout"]["fp8_recipe"] == "blockwise" for r in blockwise["ranking"])
    assert all("--precision fp8 --fp8-recipe blockwise" in r["command"] for r in blockwise["ranking"])
    assert blockwise["ranking"][0]["step_s"] > out["ranking"][0]["step_s"]
    assert main([*argv]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["precision"] == "bf16" and "fp8_recipe" not in bf16
    assert out["ranking"][0]["step_s"] < bf16["ranking"][0]["step_s"]
    assert main(argv[:-1] + ["--precision", "fp8"]) == 0
    assert "fp8 (tensorwise scaling)" in capsys.readouterr().out


def test_fp8_speedup_compares_the_best_layouts_and_the_same_layout():
    got = plan.fp8_speedup(preset("llama3-8b"), 8, 64, H200)
    bf16, fp8 = got["bf16"]["prediction"]["step_s"], got["fp8"]["prediction"]["step_s"]
    assert got["best"] == pytest.approx(bf16 / fp8)
    assert got["same_layout"] == pytest.approx(bf16 / got["fp8_same_layout"]["step_s"])
    assert fp8 <= got["fp8_same_layout"]["step_s"]  # the best fp8 layout is at least as fast as bf16's in fp8
    assert 1.2 < got["same_layout"] <= got["best"] < 2.0
    assert got["fp8"]["layout"].precision == "fp8" and got["bf16"]["layout"].precision == "bf16"


def test_the_dry_run_reports_fp8_and_its_memory():
    from megakernels_models.planning.dryrun import report

    argv = ["--preset", "llama3-8b", "--dry-run", "--nproc", "8", "--micro-batch-size", "2"]
    lines: list[str] = []
    bf16 = report(parse_train_args([*argv, "--precision", "bf16"]), out=lambda line: None)
    fp8 = report(parse_train_args([*argv, "--precision", "fp8"]), out=lines.append)
    assert fp8["layout"]["precision"] == "fp8" and fp8["layout"]["fp8_recipe"] == "tensorwise"
    assert any("precision=fp8 (tensorwise scaling" in line for line in lines)
    s, h, q, kv, f, mbs = 8192, 4096, 4096, 1024, 14336, 2
    # the saved linear inputs in 1 byte instead of 2, less the weights' FP8 copies, over 32 layers
    per_layer = mbs * s * (2 * h + q + f) - (h * (q + 2 * kv) + q * h + 3 * h * f)
    assert bf16["memory_per_device_bytes"] - fp8["memory_per_device_bytes"] == pytest.approx(per_layer * 32)
    choice = "recompute=selective,sp=False"
    saved = bf16["activations_by_choice_bytes"][choice] - fp8["activations_by_choice_bytes"][choice]
    assert saved == pytest.approx(per_layer * 32)
    quiet = lambda line: None  # noqa: E731
    blockwise = report(parse_train_args([*argv, "--precision", "fp8", "--fp8-recipe", "blockwise"]), out=quiet)
    assert blockwise["layout"]["fp8_recipe"] == "blockwise"
    assert not any("--fp8-base-precision" in w for w in blockwise["warnings"])
    fp32_base = ["--precision", "fp8", "--fp8-base-precision", "fp32"]
    warned = report(parse_train_args([*argv, *fp32_base]), out=quiet)["warnings"]
    assert any(w.startswith("--fp8-base-precision fp32: the memory above counts") for w in warned)


def test_the_fp8_commands_plan_prints_are_accepted_by_train(capsys, monkeypatch):
    argv = ["plan", "--preset", "llama3-8b", "--gpus", "16", "--top", "3", "--json", "--precision", "fp8"]
    for recipe in ("tensorwise", "blockwise"):
        assert main([*argv, "--fp8-recipe", recipe]) == 0
        for row in json.loads(capsys.readouterr().out)["ranking"]:
            words = row["command"].split()
            monkeypatch.setenv("WORLD_SIZE", "16")  # as torchrun sets it
            args = parse_train_args([*words[words.index("train") + 1 :], "--dry-run"])  # no GPU here
            validate(args)
            assert (args.precision, args.fp8_recipe) == ("fp8", recipe)


def test_fsdp_gathers_tensorwise_fp8_weights_in_one_byte(llama):
    """Under FSDP the tensorwise recipe's linear weights are all-gathered in FP8 (megakernels.parallel.fp8_gather):
    every linear of a Llama 3 8B layer (QKV, output projection, SwiGLU's three matrices), counted here; blockwise and
    bf16 gather 16 bits, and the gather's time falls with the bytes."""
    h, q, kv, f = 4096, 4096, 1024, 14336
    fsdp = dict(distributed_optimizer=False, fsdp=True, micro_batch_size=2)
    tensorwise = _layout(precision="fp8", fp8_recipe="tensorwise", **fsdp)
    blockwise = _layout(precision="fp8", fp8_recipe="blockwise", **fsdp)
    assert costs.fp8_gathered_weights(llama.config, tensorwise) == h * (q + 2 * kv) + q * h + 3 * h * f
    assert costs.fp8_gathered_weights(llama.config, blockwise) == 0
    assert costs.fp8_gathered_weights(llama.config, _layout(precision="fp8")) == 0  # ZeRO-1: no FSDP gathers
    fast, slow = (costs.predict(llama, layout, H200)["dp_s"] for layout in (tensorwise, blockwise))
    assert 0 < fast < slow
