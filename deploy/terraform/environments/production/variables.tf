# The release: set only in release.auto.tfvars beside this file (committed; every plan and apply
# here reads it), never with -var, -var-file or TF_VAR_ (deploy/check refuses a document step that
# does). No default: the file is their only source. Described in the module
# (../../modules/pubsub-outbox/variables.tf), which validates them.

variable "producer_image" {
  description = "The producer's image by digest (release.auto.tfvars)."
  type        = string
}

variable "cloud_sql_proxy_image" {
  description = "The producer job's Cloud SQL Auth Proxy by digest, the same as deploy/k8s's (release.auto.tfvars)."
  type        = string
}

variable "producer_schedule_paused" {
  description = "Pause the producer's schedule (release.auto.tfvars)."
  type        = bool
}

variable "alerts_enabled" {
  description = "Make the alert policies (release.auto.tfvars)."
  type        = bool
}
