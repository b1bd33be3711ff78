"""Tensor parallel through transformers with cupaged's paged attention: a random-weight
Llama (the tiny preset's shapes, more heads) saved once, loaded with tp_plan="auto" on
every rank, continuous batching (generate_batch) on cupaged's implementation ("paged|cupaged"
through register() on transformers 5.16 to 5.18, "paged|eager" through
override_paged_eager() from 5.19); the greedy tokens must equal a single-GPU run of the
same weights, and transformers' paged SDPA path's.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tools/tp_generate.py [--out DIR]
    (on the device: bash tools/device.sh tp)

Each rank's attention runs through cupaged on its own heads (transformers shards the
heads and the paged cache). Rank 0 prints the comparison; the exit status is 1 on a
mismatch."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (7, 40, 100, 3)]


def generate(model, implementation, new_tokens=16):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    import transformers

    # 5.18 renamed block_size page_size (the old name warns)
    old = transformers.__version__.startswith(("5.16.", "5.17."))
    cb = ContinuousBatchingConfig(**{"block_size" if old else "page_size": 16}, num_blocks=64,
                                  max_batch_tokens=64, use_cuda_graph=False)
    out = model.generate_batch(prompts(), generation_config=config,
                               continuous_batching_config=cb, warmup=False)
    errors = [r.error for r in out.values() if r.error]
    if errors:
        raise RuntimeError(errors[0])
    return [r.generated_tokens for r in out.values()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--attn", default=None,
                    help="default: cupaged's (paged|cupaged, or paged|eager overridden)")
    args = ap.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cupaged.integrations import transformers as cupaged_tf

    named = cupaged_tf._minor(transformers.__version__) in cupaged_tf.NAMED_VERSIONS
    reference = "paged|sdpa" if named else "sdpa"  # transformers' paged SDPA path
    if args.attn is not None:
        implementation = args.attn
    else:
        implementation = cupaged_tf.register() if named else cupaged_tf.override_paged_eager()
    calls = [0]  # this rank's attention calls through cupaged

    def counted(*a, **kw):
        calls[0] += 1
        return cupaged_tf.paged_attention_forward(*a, **kw)

    if args.attn is None:
        from transformers import AttentionInterface

        AttentionInterface.register(implementation, counted)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    path = os.path.join(args.out, "tp-llama")
    if rank == 0:  # random weights, saved once so every rank loads the same ones
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=32, max_position_embeddings=1024)
        AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(path)
    dist.barrier()
    sharded = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto",
                                                   torch_dtype=torch.float32)
    local = sharded.config.num_attention_heads // world
    tokens = generate(sharded, implementation)
    sharded_calls = [None] * world
    dist.all_gather_object(sharded_calls, calls[0])
    result = {"rank": rank, "world": world, "implementation": implementation,
              "tokens": tokens, "local_heads": local, "cupaged_calls_per_rank": sharded_calls}
    if rank == 0:
        single = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device)
        result["single_gpu_tokens"] = generate(single, implementation)
        result["single_gpu_sdpa_tokens"] = generate(single, reference)
        result["equal"] = tokens == result["single_gpu_tokens"] == result["single_gpu_sdpa_tokens"]
        if args.attn is None:  # every rank attended through cupaged
            result["equal"] = result["equal"] and all(c > 0 for c in sharded_calls)
        print(json.dumps(result))
        with open(os.path.join(args.out, "tp-generate.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and not result["equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
