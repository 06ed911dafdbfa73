"""What a run is asked to do: `megatrain train`'s config (config.py: every key with its group,
default and help), LLaMA-Factory's keys and what megatrain does with each (lf_keys.py), the
fine-tuning method's and the schedule's keys (finetuning_args.py, schedule.py), the NVMe tier's
(tier_keys.py), and the key listing of `--help` (keys_help.py). The first layer of the training
package: it imports no other part of it (hparams -> data -> model -> checkpoint -> the loop ->
the stage workflows)."""
