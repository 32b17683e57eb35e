# TFLint for the module and its example (tests/unit/test_tfvars.py runs it when `make tools`
# could build it). Only the terraform ruleset bundled in TFLint is used: nothing is downloaded.
plugin "terraform" {
  enabled = true
  preset  = "all"
}
