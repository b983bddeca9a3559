# pubsub-outbox on Google Cloud: Pub/Sub topics, the Cloud SQL (PostgreSQL) outbox database, the
# service accounts, the producer as a scheduled Cloud Run Job. The dispatcher itself runs on GKE
# from deploy/k8s (this configuration creates its Google service account and grants).
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 6.39.0 is the first with the Cloud Run job container's depends_on and startup_probe
      # (cloudrun_job.tf: the producer starts once its proxy sidecar is ready); an older 6.x would
      # refuse the configuration. 7.0 is a major release with breaking changes: move on purpose.
      version = ">= 6.39, < 7"
    }
  }

  # The state holds no password (every workload uses IAM database authentication), but it does
  # hold the streams file and the whole inventory: keep it in an access-controlled bucket.
  # backend "gcs" {
  #   bucket = "TFSTATE_BUCKET"
  #   prefix = "pubsub-outbox"
  # }
}

provider "google" {
  project = var.project_id
  region  = var.region
  # Applied to every resource that takes labels.
  default_labels = merge({ app = var.name_prefix }, var.labels)
}
