"""An independent cross-check of the toy distillation result (benchmarks/RESULTS.md, "On-policy distillation on the
toy task"): the same on-policy distillation in plain PyTorch + transformers, no pyrl trainer. The student
(pyrl:tiny-toy-sft) samples 8 answers to each of 64 training prompts (HF generate, temperature 1); the teacher scores
them (top 32 log-probs at each response position); two Adam steps on the forward KL over the teacher's top 32 (token
mean over the responses up to their end-of-turn token); the student's greedy held-out reward on 128 test prompts
every 10 iterations.

    python benchmarks/distillation_crosscheck.py TEACHER_DIR [--lr 3e-4] [--iterations 40]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pyrl.data.toy import toy_pairs, toy_prompt
from pyrl.models.hub import resolve_model_path
from pyrl.rewards import default_compute_score

K, SAMPLES, PROMPTS = 32, 8, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("teacher")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    student_path = resolve_model_path("pyrl:tiny-toy-sft")
    tok = AutoTokenizer.from_pretrained(student_path)
    tok.padding_side = "left"
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    train, _, test = toy_pairs(0)

    def encode(pairs):
        texts = [tok.apply_chat_template([{"role": "user", "content": toy_prompt(a, b)}], tokenize=False,
                                         add_generation_prompt=True) for a, b in pairs]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def greedy_reward(model, pairs):
        enc = encode(pairs)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(default_compute_score("pyrl/toy_addition", r, str(a + b)) for r, (a, b) in zip(answers, pairs)) \
            / len(pairs)

    print(f"greedy held-out reward: student {greedy_reward(student, test[:128]):.3f}, teacher "
          f"{greedy_reward(teacher, test[:128]):.3f}", flush=True)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)
    rng = random.Random(0)
    for iteration in range(args.iterations):
        enc = encode(rng.sample(train, PROMPTS))
        with torch.no_grad():
            out = student.generate(**enc, max_new_tokens=8, do_sample=True, top_k=0, temperature=1.0,
                                   pad_token_id=tok.pad_token_id, num_return_sequences=SAMPLES)
        width = enc["input_ids"].shape[1]
        is_end = (out[:, width:] == tok.eos_token_id).long()
        response_mask = ((is_end.cumsum(1) - is_end) == 0).float()  # up to and including the end-of-turn token
        attention = torch.cat([enc["attention_mask"].repeat_interleave(SAMPLES, 0), response_mask.long()], 1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = teacher(input_ids=out, attention_mask=attention, position_ids=positions).logits
            teacher_top, teacher_ids = logits[:, width - 1:-1].float().log_softmax(-1).topk(K, -1)
        for _ in range(2):
            logits = student(input_ids=out, attention_mask=attention, position_ids=positions).logits
            student_at = logits[:, width - 1:-1].float().log_softmax(-1).gather(-1, teacher_ids)
            kl = (teacher_top.exp() * (teacher_top - student_at)).sum(-1).clamp_min(0)
            loss = (kl * response_mask).sum() / response_mask.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if iteration % 10 == 9:
            print(f"iteration {iteration + 1}: distillation loss {loss.item():.3f}, greedy held-out reward "
                  f"{greedy_reward(student, test[:128]):.3f}", flush=True)


if __name__ == "__main__":
    main()
