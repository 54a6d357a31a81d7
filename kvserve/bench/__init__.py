"""Measurement harness (book §31.2, §31.7): workloads, replay (HTTP or in-process), metrics with
stated windows, cost, hard gates and goodput, reports and plots. CLI: `kvserve bench ...`."""
