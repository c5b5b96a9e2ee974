"""Train a Hugging Face causal LM with ``transformers.Trainer`` at any ZeRO rung: ZeroTrainer.

The lines that change from a plain Trainer script are marked ``# zkernels``: the import, and
``ZeroTrainer(..., zero_config=...)`` instead of ``Trainer(...)``. Everything else
(TrainingArguments, the LR schedule, accumulation, clipping, ``save_steps`` checkpoints,
``resume_from_checkpoint``, ``save_model``) is Trainer's. A tiny Llama built from a config
(random init: nothing is downloaded) learns the Shakespeare slice shipped in zkernels, one byte
per token. Needs ``pip install zkernels[hf]`` (transformers, accelerate).

    # 2 processes on one machine (CPU: gloo; GPUs: NCCL)
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --stage 3 --steps 40
    # stage 2 with the optimizer states in host RAM, then resume the last checkpoint on 1 rank
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --stage 2 --offload cpu
    python examples/hf_trainer.py --stage 2 --steps 60 --batch-size 16 --resume
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                          TrainingArguments)

from zkernels._cli import writable_folder
from zkernels.demo.data import VOCAB_SIZE, decode, encode, load_corpus
from zkernels.integrations.transformers import ZeroTrainer  # zkernels


class Blocks(torch.utils.data.Dataset):
    """The corpus cut into rows of ``block`` tokens, as causal-LM inputs and labels."""

    def __init__(self, block: int) -> None:
        tokens = load_corpus()
        self.rows = tokens[:len(tokens) // block * block].view(-1, block)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="2", help='1, 2, 3 or "auto"')
    ap.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none")
    ap.add_argument("--offload-dir", type=writable_folder, default=None,
                    help="an existing folder that can hold files, with --offload nvme")
    ap.add_argument("--offload-params", action="store_true", help="stage 3 with --offload: "
                    "keep the parameter shards in host RAM too")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--output-dir", default="hf_trainer_out")
    ap.add_argument("--resume", action="store_true", help="resume from the last checkpoint "
                    "in --output-dir (saved at any world size)")
    ap.add_argument("--config", default='{"hidden_size": 64, "intermediate_size": 128, '
                    '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}',
                    help="JSON overrides of LlamaConfig")
    args = ap.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, logging_steps=max(1, args.steps // 10),
        save_steps=args.save_steps, report_to=[], disable_tqdm=True, seed=0,
        use_cpu=not torch.cuda.is_available())
    config = LlamaConfig(**json.loads(args.config), vocab_size=VOCAB_SIZE,
                         max_position_embeddings=args.block_size, bos_token_id=None,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(config)
    zero_config = {"stage": args.stage if args.stage == "auto" else int(args.stage)}
    if args.offload != "none":
        zero_config.update(offload=args.offload, offload_dir=args.offload_dir,
                           offload_params=args.offload_params)
    trainer = ZeroTrainer(model=model, args=training_args,  # zkernels
                          train_dataset=Blocks(args.block_size), zero_config=zero_config)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    final = f"{args.output_dir}/final"
    trainer.save_model(final)   # collective: every rank calls it
    opt = trainer.optimizer
    if trainer.is_world_process_zero():
        print(f"stage {opt.stage}, offload {opt.offload}, {training_args.world_size} ranks: "
              f"{trainer.state.global_step} steps, train loss {result.training_loss:.4f}",
              flush=True)
        # The saved folder is an ordinary Hugging Face model.
        loaded = AutoModelForCausalLM.from_pretrained(final).eval()
        prompt = torch.tensor([encode("ROMEO:")])
        out = loaded.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        print(f"saved to {final}; sample: {decode(out[0].tolist())!r}", flush=True)
    opt.close()
    if dist.is_initialized():   # end as every torch.distributed program should (README)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
