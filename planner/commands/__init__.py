"""The `piper-plan` subcommands, a module each (run, search, simulate, machine: profile and
clusters, studies: show, export, export-weights), sharing `common`'s public helpers. They may
import every package below the planner and planner's own modules; only `planner.cli` imports
them."""
