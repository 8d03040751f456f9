"""Evaluations of a model: the trainer's periodic ones, and lm-evaluation-harness.

base.py        what an evaluation is to the trainer: when it runs, the records it logs, what it plots
periodic.py    the registry of the trainer's evaluations, and the runner that calls them
val_loss.py    loss over the fixed val window, the same figure on any number of ranks
hellaswag.py   HellaSwag accuracy by completion likelihood (the data, its scoring, the evaluation)
samples.py     text samples from a prompt
lm_eval_harness.py   our GPT as an lm-evaluation-harness model (eval_lm.py)
"""
