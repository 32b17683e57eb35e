terraform {
  # 1.5 for strcontains(); the toolchain (terraform/tools/install.sh) builds exactly 1.5.7.
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    libvirt = {
      source = "dmacvicar/libvirt"
      # 0.7.6 exactly: the module relies on its schema (base_volume_id overlays, xml { xslt },
      # cloud-init ISOs built with mkisofs). The 0.9 rewrite has a different schema.
      version = "= 0.7.6"
    }
  }
}
