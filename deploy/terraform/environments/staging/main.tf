# The staging install: the provider, and the pubsub-outbox module with staging's settings written
# out. Everything an apply here reads is committed in this directory: these settings, the release
# (release.auto.tfvars), the producer's streams (streams.toml). Run from here:
#   terraform init && terraform plan -out plan && terraform apply plan
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 8.7, < 9"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = ">= 8.7, < 9"
    }
  }
}

locals {
  project_id = "my-project-staging"
  region     = "europe-west1"
  # Applied to every resource that takes labels.
  labels = { app = "pubsub-outbox", environment = "staging" }
}

provider "google" {
  project        = local.project_id
  region         = local.region
  default_labels = local.labels
}

# Only for the service agents of a customer-managed key (kms_key_name; the module's kms.tf).
provider "google-beta" {
  project        = local.project_id
  region         = local.region
  default_labels = local.labels
}

module "pubsub_outbox" {
  source = "../../modules/pubsub-outbox"

  project_id = local.project_id
  region     = local.region

  topics = ["orders", "payments"]

  # An existing VPC with Private Service Access, and a subnet in the region for the producer's
  # Direct VPC egress.
  network                       = "projects/my-project-staging/global/networks/main"
  create_private_service_access = false
  run_subnetwork                = "projects/my-project-staging/regions/europe-west1/subnetworks/serverless"

  # The dispatcher's GKE cluster (its alert policies and the dashboard read only its series; the
  # CLUSTER_NAME of the overlay) and its nodes' service account (reads the images' repository).
  gke_cluster_name         = "outbox-cluster"
  gke_node_service_account = "gke-nodes@my-project-staging.iam.gserviceaccount.com"

  # A smaller, single-zone database than production's; still protected from deletion.
  postgres_version     = "POSTGRES_15"
  db_tier              = "db-custom-1-3840"
  db_availability_type = "ZONAL"
  db_max_connections   = 100
  deletion_protection  = true

  bigquery_datasets = [
    { dataset_id = "sales" },
  ]

  # The producer's streams, committed beside this file (never a git-ignored copy).
  producer_streams  = file("${path.module}/streams.toml")
  producer_schedule = "*/15 * * * *"

  # The people on call, as themselves (deploy/README.md, "Operators").
  operator_groups = ["outbox-oncall@example.com"]

  # Staging's alerts, paging and warning alike, go to the team's email channel.
  alert_notification_channels         = ["projects/my-project-staging/notificationChannels/1234567890"]
  alert_warning_notification_channels = ["projects/my-project-staging/notificationChannels/1234567890"]

  # The release (release.auto.tfvars), passed through unchanged.
  producer_image           = var.producer_image
  cloud_sql_proxy_image    = var.cloud_sql_proxy_image
  producer_schedule_paused = var.producer_schedule_paused
  alerts_enabled           = var.alerts_enabled
}
