"""Training drafts from a target alone (PyTorch; the export extra): `edgespec train-draft`."""
