"""One rank of the two-process Megatron tests (gloo on the CPU): ``python -m tests.megatron.parallel_worker
RANK WORLD PORT OUT_DIR SCENARIO...`` writes ``OUT_DIR/rank<RANK>.json`` with what each scenario measured,
or its traceback. test_megatron_parallel.py starts two of them and asserts on both files.

Scenarios (each rank runs the same code; both ranks hold the same TP=1 reference, built from the same seed):

- ``tp``: Megatron's TP=2 compiled with laqat, against the TP=1 model. The TP=2 model's weights are the
  TP=1 model's, cut the way Megatron lays its shards out (megatron_models.tp_shard). Exact numerics against
  the eager TP=1 model; ``state_fp8`` against laqat's TP=1 ``state_fp8`` run. Gradients are compared shard by
  shard, after summing over the TP group the one replicated parameter whose gradient is per rank: GDN's
  ``out_norm.weight``, a norm over the head dim that each rank applies to its own heads only. Megatron sums
  such gradients only with sequence parallelism (finalize_model_grads, parameters marked
  ``sequence_parallel``), which its torch norms refuse (it needs Transformer Engine or Apex norms): without
  it, Megatron 0.19.2 leaves the two ranks' gradients of that weight different (``out_norm_grad_ranks_differ``).
- ``cp``: context parallelism 2 (Megatron's GDN all-to-alls from sequence shards to head shards around the
  recurrence), against the TP=1 model on the tokens of this rank, gradients summed over the CP group.
- ``checkpoint``: a TP=2 model with an FP8-state policy attached (``la_compiler.attach_policy``: a buffer, so
  in Megatron's sharded state dict) trained one SGD step under laqat is saved with Megatron's
  ``dist_checkpointing``, restored at TP=2 and at TP=1 into freshly initialized models (the policy read from
  the checkpoint first, ``policy_in_checkpoint``), recompiled with the attached policy; the next batch's
  loss, and the loss after one more SGD step, at each.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

T = 32  # divisible by 2 * CP; FLA's call reaches the node at any length
SGD_LR = 0.5
# state_fp8 with chunks of 16: the state is rounded between chunks at T = 32
STATE_FP8 = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                           {"quantizer_name": "*gdn_state_quantizer",
                            "cfg": {"num_bits": [4, 3], "type": "dynamic", "axis": [0, 1]}}],
             "linear_attention": [{"module_name": "*", "cfg": {"chunk_size": 16, "state": {"block_v": 64}}}],
             "name": "state_fp8_chunk16"}


def _config(tp=1, cp=1):
    from tests.megatron.megatron_models import tiny_config

    return tiny_config(tp=tp, cp=cp, layers=1, key_heads=2, value_heads=4)


def _capturing_laqat(options, graphs):
    from la_compiler.backend import laqat_backend

    def backend(gm, example_inputs):
        compiled = laqat_backend(gm, example_inputs, options=options)
        graphs.append(gm)
        return compiled

    return backend


def _nodes(graphs):
    """(module, spec, local value heads) of every laqat recurrence node the compiled graphs hold."""
    from la_compiler.ir.delta_rule import is_delta_rule

    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if is_delta_rule(node):
                v = node.args[2].meta["example_value"]
                found.append((node.meta["laqat"].module, node.meta["laqat"].spec.to_string(), int(v.shape[2])))
    return found


def _run(model, fn, ids, pos, labels):
    for p in model.parameters():
        p.grad = None
    loss = fn(ids, pos, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


OUT_NORM = "decoder.layers.0.self_attention.out_norm.weight"


def _reduce_grads(model, grads, group, only=None):
    """Sums over ``group`` the gradients of every parameter (of ``only``, if given)."""
    for name in grads:
        if only is None or name == only:
            dist.all_reduce(grads[name], group=group)
    return grads


def _errors(got: dict, expected: dict) -> dict:
    from tests.helpers import rel_l2

    return {name: rel_l2(got[name], expected[name]) for name in expected}


def _reference(policy):
    """The TP=1 model: eager (the oracle) and, for ``policy``, compiled with laqat."""
    from tests.megatron.megatron_models import batch, tiny_gpt
    from tests.megatron.megatron_oracle import eager_megatron

    model = tiny_gpt(_config())
    ids, pos, labels = batch(1, T)
    with eager_megatron(model):
        eager = _run(model, model, ids, pos, labels)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = None
    if policy is not None:
        compiled = _run(model, torch.compile(model, backend="laqat",
                                             options={"policy": policy, "compiler": "eager"}), ids, pos, labels)
    return state, eager, compiled, (ids, pos, labels)


def scenario_tp(rank, world):
    from megatron.core import parallel_state

    from tests.megatron.megatron_cpu import model_parallel
    from tests.megatron.megatron_models import tiny_gpt, tp_shard

    with model_parallel(tp=1):
        state, eager, fp8_tp1, data = _reference(STATE_FP8)
    result = {}
    with model_parallel(tp=2):
        group = parallel_state.get_tensor_model_parallel_group()
        for label, policy, (ref_loss, ref_grads) in (("exact", "exact", eager), ("state_fp8", STATE_FP8, fp8_tp1)):
            torch._dynamo.reset()
            model = tiny_gpt(_config(tp=2), seed=1)
            shards = tp_shard(state, model, 2, rank)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(shards[name])
            graphs = []
            compiled = torch.compile(model, backend=_capturing_laqat({"policy": policy, "compiler": "eager"}, graphs),
                                     fullgraph=True)
            loss, grads = _run(model, compiled, *data)
            local_norm_grad = grads[OUT_NORM].clone()
            grads = _reduce_grads(model, grads, group, OUT_NORM)
            from tests.helpers import rel_l2

            result[label] = {
                "loss": rel_l2(loss, ref_loss),
                "grads": _errors(grads, tp_shard(ref_grads, model, 2, rank)),
                "nodes": _nodes(graphs),
                "graphs": len(graphs),
                "out_norm_grad_ranks_differ": rel_l2(local_norm_grad, grads[OUT_NORM] - local_norm_grad),
            }
    from tests.helpers import rel_l2

    result["fp8_vs_exact_tp1"] = rel_l2(fp8_tp1[0], eager[0])
    return result


def scenario_cp(rank, world):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from tests.helpers import rel_l2
    from tests.megatron.megatron_cpu import model_parallel
    from tests.megatron.megatron_models import tiny_gpt

    with model_parallel(tp=1):
        state, (ref_loss, ref_grads), _, (ids, pos, labels) = _reference(None)
    with model_parallel(tp=1, cp=2):
        group = parallel_state.get_context_parallel_group()
        model = tiny_gpt(_config(cp=2), seed=1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[name])
        graphs = []
        compiled = torch.compile(model, backend=_capturing_laqat({"compiler": "eager"}, graphs), fullgraph=True)
        local = get_batch_on_this_cp_rank({"ids": ids, "pos": pos, "labels": labels, "positions": pos.clone(),
                                           "cu_seqlens": None}, is_hybrid_cp=False, cp_group=group)
        loss, grads = _run(model, compiled, local["ids"], local["pos"], local["labels"])
        grads = _reduce_grads(model, grads, group)
        ref_local = ref_loss.gather(1, local["positions"])
        return {"loss": rel_l2(loss, ref_local), "grads": _errors(grads, ref_grads), "nodes": _nodes(graphs),
                "graphs": len(graphs), "tokens": local["positions"][0].tolist()}


def _sgd_step(model, fn, data, group):
    loss = fn(*data[:2], None, labels=data[2])
    loss.mean().backward()
    if group is not None:  # the per-rank gradient of GDN's out_norm weight (scenario_tp)
        _reduce_grads(model, {n: p.grad for n, p in model.named_parameters()}, group, OUT_NORM)
    with torch.no_grad():
        for p in model.parameters():
            p -= SGD_LR * p.grad
            p.grad = None
    return loss.detach()


def _loss(compiled, data):
    """The per-token loss, with autograd on (a no_grad call would compile a second graph)."""
    return compiled(*data[:2], None, labels=data[2]).detach()


def policy_in_checkpoint(path):
    """The policy a ``dist_checkpointing`` checkpoint holds (the attached policy's buffer, la_compiler.POLICY_KEY),
    read on its own: a fresh model has no buffer of that length to load it into."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from la_compiler.policy.attach import POLICY_KEY, policy_of

    meta = dist_checkpointing.load_tensors_metadata(path)[POLICY_KEY]
    request = ShardedTensor.from_rank_offsets(POLICY_KEY, torch.empty(meta.global_shape, dtype=meta.dtype),
                                              replica_id=dist.get_rank())
    return policy_of(dist_checkpointing.load({POLICY_KEY: request}, path, validate_access_integrity=False))


def scenario_checkpoint(rank, world, out_dir):
    from megatron.core import dist_checkpointing, parallel_state

    import la_compiler
    from la_compiler.policy.resolution import load_policy
    from tests.helpers import rel_l2
    from tests.megatron.megatron_cpu import model_parallel
    from tests.megatron.megatron_models import batch, tiny_gpt

    policy = load_policy(STATE_FP8)
    data = [batch(1, T, seed=s) for s in range(4)]
    path = os.path.join(out_dir, "checkpoint")
    with model_parallel(tp=2):
        group = parallel_state.get_tensor_model_parallel_group()
        torch._dynamo.reset()
        model = la_compiler.attach_policy(tiny_gpt(_config(tp=2), seed=2), policy)  # a buffer: in the state dict
        compiled = torch.compile(model, backend="laqat", options={"compiler": "eager"})  # the attached policy
        _sgd_step(model, compiled, data[0], group)
        before, unstepped = _loss(compiled, data[2]), _loss(compiled, data[3])  # unstepped: without the next step
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), path)

    losses = {}
    for tp in (2, 1):
        with model_parallel(tp=tp):
            group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
            torch._dynamo.reset()
            restored_policy = policy_in_checkpoint(path)
            model = la_compiler.attach_policy(tiny_gpt(_config(tp=tp), seed=3), restored_policy)
            loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
            missing, unexpected = model.load_state_dict(loaded, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
            compiled = torch.compile(model, backend="laqat", options={"compiler": "eager"})
            resumed = _loss(compiled, data[2])
            _sgd_step(model, compiled, data[2], group)
            losses[tp] = {"resumed": resumed, "after": _loss(compiled, data[3]),
                          "policy": la_compiler.policy_of(model) == policy}
    return {
        "resumed_tp2": rel_l2(losses[2]["resumed"], before), "resumed_tp1": rel_l2(losses[1]["resumed"], before),
        "after_tp1_vs_tp2": rel_l2(losses[1]["after"], losses[2]["after"]),
        "step_moved_tp2": rel_l2(losses[2]["after"], unstepped),
        "policy_restored": [losses[2]["policy"], losses[1]["policy"]],
    }


SCENARIOS = {"tp": scenario_tp, "cp": scenario_cp, "checkpoint": scenario_checkpoint}


def main(rank: int, world: int, port: int, out_dir: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    results = {"import_cpu_seconds": time.process_time()}
    from tests.megatron.megatron_cpu import cuda_calls_on_cpu, init_gloo

    init_gloo(rank, world, port)
    with cuda_calls_on_cpu():
        for name in scenarios:
            start = time.process_time()
            try:
                args = (rank, world, out_dir) if name == "checkpoint" else (rank, world)
                results[name] = {"ok": True, **SCENARIOS[name](*args), "cpu_seconds": time.process_time() - start}
            except BaseException:  # torch.distributed.checkpoint's CheckpointException is a BaseException
                results[name] = {"ok": False, "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
