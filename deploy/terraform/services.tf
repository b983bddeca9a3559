# The APIs this configuration and the workloads use. Left enabled on destroy: other things in the
# project may depend on them.
locals {
  services = [
    "bigquery.googleapis.com",          # the producer's queries
    "cloudscheduler.googleapis.com",    # the producer's schedule
    "compute.googleapis.com",           # Private Service Access address, Direct VPC egress
    "iam.googleapis.com",               # service accounts
    "pubsub.googleapis.com",            # topics
    "run.googleapis.com",               # the producer job
    "secretmanager.googleapis.com",     # streams file, database URLs
    "servicenetworking.googleapis.com", # Private Service Access
    "sqladmin.googleapis.com",          # Cloud SQL; also called by the Auth Proxy and Cloud Run's /cloudsql
  ]
}

resource "google_project_service" "enabled" {
  for_each = toset(local.services)

  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}
