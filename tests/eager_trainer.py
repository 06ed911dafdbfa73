"""The reference a `megatrain train` run is checked against: eager PyTorch on the same model,
data pipeline and step arithmetic, with nothing of megatrain's compiler or runtime.

    ref = eager_run(config)   # {"losses", "grad_norms", "lrs", "tokens", "eval": {step: loss}}

Shared with the trainer (what is under test is the compiled step, not these): the model source
(ModelSource.load: the weights in the configured dtype), the fine-tuning selection
(apply_finetuning: freeze / LoRA), the data (trainer._data: examples, the eval split, the sample
order), `collate`, the LR schedule (schedule.make_scheduler) and the eval schedule. Eager here:
the model's own forward (transformers' attention, its own loss with num_items_in_batch), autograd,
fp32 gradient buffers (each micro-batch's gradient added in fp32, as megatrain's store does),
clipping by the global norm, torch.optim.AdamW on fp32 masters with the trainer's two parameter
groups (no weight decay on biases and norms), and the low-precision copy refreshed from the
masters after each step.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from megacompile.train import schedule

from megacompile.train import trainer
from megacompile.train.data import IGNORE, check_datasets, collate
from megacompile.train.evaluate import Schedule as EvalSchedule, evaluate
from megacompile.train.model.finetuning import apply_finetuning
from megacompile.train.model.model_source import ModelSource


def eager_run(config) -> dict:
    trainer._seed(config.seed)
    source = ModelSource(config, torch.device("cpu"))
    examples, split, order, steps_per_epoch, _ = trainer._data(config, source.tokenizer, None,
                                                               check_datasets(config))
    model, tokenizer, _ = source.load()
    apply_finetuning(model, config)
    trained = [p for p in model.parameters() if p.requires_grad]
    masters = {p: p.detach().float().clone() for p in trained}
    decay = [masters[p] for p in trained if p.dim() >= 2]
    no_decay = [masters[p] for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=config.learning_rate,
                            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    total = config.max_steps
    scheduler = schedule.make_scheduler(opt, config, total)
    evals = EvalSchedule(config, total, steps_per_epoch)
    held = split.parts or split.examples
    out = {"losses": [], "grad_norms": [], "lrs": [], "tokens": [], "eval": {}}
    per, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    for step in range(1, total + 1):
        micro = [collate(order.next_examples(examples)[:per], tokenizer.pad_token_id) for _ in range(accum)]
        tokens = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in micro)
        count = torch.tensor(max(tokens, 1))
        grads = {p: torch.zeros(p.shape, dtype=torch.float32) for p in trained}
        loss = 0.0
        for mb in micro:
            step_loss = model(**mb, num_items_in_batch=count, use_cache=False).loss
            step_loss.backward()
            loss += step_loss.item()
            for p in trained:
                if p.grad is not None:
                    grads[p] += p.grad.float()
                    p.grad = None
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        clip = min(1.0, config.max_grad_norm / (norm + 1e-6)) if config.max_grad_norm > 0 else 1.0
        lr = scheduler.get_last_lr()[0]
        if math.isfinite(loss) and math.isfinite(norm):
            for p in trained:
                masters[p].grad = grads[p] * clip
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p in trained:
                    p.copy_(masters[p])
        scheduler.step()
        out["losses"].append(loss)
        out["grad_norms"].append(norm)
        out["lrs"].append(lr)
        out["tokens"].append(tokens)
        if evals.due(step):
            sets = held if isinstance(held, dict) else {"": held}
            for name, part in sets.items():
                loss_eval, _, _ = evaluate(model, model, SimpleNamespace(synchronize=lambda: None), part,
                                           config.per_device_eval_batch_size, tokenizer.pad_token_id)
                out["eval"][(name, step)] = loss_eval
    out["masters"] = {n: masters[p] for n, p in model.named_parameters() if p in masters}
    return out
