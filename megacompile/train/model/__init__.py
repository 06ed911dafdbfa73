"""The model a run trains: where it comes from (model_source.py: a Hub id, a folder, the
embedded quickstart model), which of its weights train (finetuning.py: full, freeze.py, lora.py)
and the Hugging Face folder its weights and files are written as (hf_folder.py)."""
