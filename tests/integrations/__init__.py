"""Tests of the framework integrations (`torch_msa/integrations`)."""
