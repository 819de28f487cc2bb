"""Kernel registry and backends: the portable op API (`ops`), the registry (`registry`), the
plain-torch reference backend (`reference`) every op has, and faster backends as they come."""
