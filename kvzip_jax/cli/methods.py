"""kvzip-jax methods: the compression methods of the registry as a markdown table (name, family, whether it sees
the question, paper, what it does), or one method's inputs and options."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from kvzip_jax import methods

    if args.name is None:
        print(methods.table())
        return 0
    method = methods.get(args.name)
    print(
        f"{method.name}: {method.description}\n"
        f"family: {method.family} ({methods.FAMILIES[method.family]})\n"
        f"sees the question: {'yes' if method.question_aware else 'no'}\npaper: {method.paper}\n"
        f"inputs: {', '.join(method.needs) or 'none'} (needed); {', '.join(method.uses) or 'none'} (used if given)"
    )
    print("options:" + "".join(f"\n  {name} = {value!r}" for name, value in method.option_defaults().items()))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("methods", help="list the compression methods (a markdown table), or describe one")
    parser.add_argument("name", nargs="?", help="a method: its inputs and options with their defaults")
    parser.set_defaults(handler=run, subparser=parser)
