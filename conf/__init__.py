"""Hydra configuration groups (installed as slimlm.conf so Hydra finds them with pkg://)."""
