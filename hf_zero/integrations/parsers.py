"""argparse's private names hf_zero reads from the parsers transformers (HfArgumentParser) and accelerate (its launch
parser) build (entries in registry.py). argparse has no public list of a parser's arguments (Python 3.11)."""

from __future__ import annotations

__all__ = ["parser_actions", "group_dests", "set_action_types"]


def parser_actions(parser) -> list:
    """Every argument of `parser` (ArgumentParser._actions): the recipe's flags and their types, to check YAML keys
    and values as the command line would. Can go when argparse lists a parser's actions publicly."""
    return parser._actions


def group_dests(parser, title: str) -> set[str]:
    """The destinations of the arguments in `parser`'s group titled `title` (_action_groups, _group_actions): the
    keys accelerate understands under deepspeed_config: / fsdp_config:. Can go when accelerate publishes them."""
    group = next(g for g in parser._action_groups if g.title == title)
    return {a.dest for a in group._group_actions}


def set_action_types(parser, dests, convert) -> None:
    """The arguments of `parser` named in `dests` convert their value with `convert`.

    Sets the `type` of the actions transformers' HfArgumentParser (5.23.0) built: it reads a `str | bool` field as a
    bool and refuses its words ("non_padding"). Can go when HfArgumentParser parses Union[str, bool] fields."""
    for action in parser._actions:
        if action.dest in dests:
            action.type = convert
