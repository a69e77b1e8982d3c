"""Structured output in the scheduler: constraints (common/contract/constraint.py) compiled with
llguidance against the model's vocabulary, and each constrained sequence's place in its grammar,
advanced with every token the scheduler appends and sent to the worker as a per-step token mask; or,
with --grammar-masks worker, sent once as the grammar's text (CompiledConstraint.grammar.text) for the
worker to advance a matcher of its own, built from the same tokenizer (ConstraintCompiler.grammar_tokenizer,
common/contract/grammar_tokenizer.py), while the scheduler's still validates and ends the output.

The door: ConstraintCompiler (compile once, cached, off the event loop, within a time limit),
CompiledConstraint (new_state() per sequence) and the TokenMask encoding.
"""
from scheduler_service.constraints.compiler import CompiledConstraint, ConstraintCompiler
from scheduler_service.constraints.state import ConstraintState
from scheduler_service.constraints.token_mask import allowed_token_ids, write_token_mask

__all__ = ["CompiledConstraint", "ConstraintCompiler", "ConstraintState", "allowed_token_ids", "write_token_mask"]
