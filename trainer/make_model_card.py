"""Write the model card (README.md) of a drafter folder from the template and a results file.

    python trainer/make_model_card.py --folder model_cards/NAME --drafter_key dflash-carryover \
        --results examples/results/RUN/tau/summary.json [T1_SUMMARY] --training_file trainer/configs/card_training.md
"""

import argparse
import json
from pathlib import Path

from hf_carryover.model_card import write_model_card


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", required=True)
    p.add_argument("--name", help="card title (default: folder name)")
    p.add_argument("--repo_id", help="Hub repo id for the quick start (default: hf-carryover/<name>)")
    p.add_argument("--base_model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--results", nargs="+", help="summary.json file(s) of examples/evaluate_tau.py (e.g. T=0, then T=1)")
    p.add_argument("--drafter_key", help="drafter name used in the results file")
    p.add_argument("--training_file", help="markdown describing data and procedure")
    p.add_argument("--lookup_results", nargs="+", help="summary.json file(s) measuring the drafter with context lookup "
                   "(an evaluate_tau.py spec `KEY=FOLDER,lookup=N`)")
    p.add_argument("--lookup_key", help="the drafter's label in --lookup_results")
    p.add_argument("--tree_results", nargs="+", help="summary.json file(s) measuring the drafter with its draft tree "
                   "in the engine (evaluate_tau.py --engine, NAME=FOLDER,tree=...,tree_nodes=N)")
    p.add_argument("--tree_keys", nargs="+", help="the drafter's labels in --tree_results, one table each")
    args = p.parse_args()
    name = args.name or Path(args.folder).name
    summary = [json.loads(Path(f).read_text()) for f in args.results] if args.results else None
    training = Path(args.training_file).read_text() if args.training_file else ""
    path = write_model_card(args.folder, name=name, repo_id=args.repo_id or f"hf-carryover/{name}",
                            base_model=args.base_model, summary=summary, drafter_key=args.drafter_key,
                            training_text=training, sources=args.results,
                            lookup_summary=[json.loads(Path(f).read_text()) for f in args.lookup_results or []],
                            lookup_key=args.lookup_key, lookup_sources=args.lookup_results,
                            tree_summary=[json.loads(Path(f).read_text()) for f in args.tree_results or []],
                            tree_keys=args.tree_keys, tree_sources=args.tree_results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
