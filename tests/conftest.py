"""Shared fixtures: recorded seeds for every randomized test."""

from __future__ import annotations

SEEDS = [0, 1, 7, 2026]
