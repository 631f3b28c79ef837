"""Shipped policy recipes, loadable by name."""
