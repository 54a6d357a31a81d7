"""The book's fixed workload and emission schedules (chapter 31), the project's own fixtures: tests and
benchmarks read them from here, so a clone anywhere has them. README.md here gives their provenance."""

from pathlib import Path

BOOK_WORKLOADS = Path(__file__).resolve().parent
