"""`piper-plan show` and `export` (a search's study) and `export-weights` (a checkpoint as
one state dict)."""

from __future__ import annotations

import argparse

from planner.commands.common import EXIT_OK, emit, log


def show(args: argparse.Namespace) -> int:
    from planner.report.studies import load, show_json, show_text

    study = load(args.storage, args.study_name)
    if args.json:
        emit(show_json(study))
    else:
        print(show_text(study))
    return EXIT_OK


def export(args: argparse.Namespace) -> int:
    from planner.report.studies import export as export_trial
    from planner.report.studies import export_to, load
    from planner.report.tables import predicted_line, summary_line

    study = load(args.storage, args.study_name)
    if args.to:
        path, rec, notes = export_to(study, args.trial, args.to, args.out)
        for note in notes:
            log(f"{args.to}: {note}")
    else:
        path, rec = export_trial(study, args.trial, args.out)
    log(f"wrote {path}: trial {rec.number}: {summary_line(rec.summary)}\n"
        f"      {predicted_line(rec.predicted)}")
    return EXIT_OK


def export_weights(args: argparse.Namespace) -> int:
    from runtime.train import export_weights as weights

    n = weights.export_weights(args.checkpoint, args.out)
    log(f"wrote {args.out}: {n} tensors")
    return EXIT_OK
