"""train-supervisor: the on-server supervisor for rented GPU training machines."""

__version__ = "0.1.0"
