# A root module for one pgcarve host, primary or standby: reads the variables `pgcarve plan
# --format tfvars` wrote (a .tfvars.json file) and applies the module to that host. Keep one
# state per host: a workspace per host with -var-file, or a copy per host (../../README.md).
#
#   pgcarve plan --host h0 --instances 1 --format tfvars > h0.tfvars.json
#   terraform init && terraform workspace select -or-create h0 && terraform apply -var-file=h0.tfvars.json

provider "libvirt" {
  uri = var.libvirt_uri
}

module "pgcarve_host" {
  source = "../.."

  create_pool    = var.create_pool
  domain_type    = var.domain_type
  image          = var.image
  instances      = var.instances
  kernel_cmdline = var.kernel_cmdline
  network_name   = var.network_name
  pool_name      = var.pool_name
  pool_path      = var.pool_path
  seeds          = var.seeds
  wait_for_lease = var.wait_for_lease
}
