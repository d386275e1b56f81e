"""Hosts: one small interface (base.Host), implemented by LocalHost and SshHost."""
