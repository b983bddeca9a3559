# pubsub-outbox on Google Cloud: Pub/Sub topics, the Cloud SQL (PostgreSQL) outbox database, the
# service accounts, the producer as a scheduled Cloud Run Job, the images' Artifact Registry
# repository. The dispatcher itself runs on GKE from deploy/k8s (this module creates its Google
# service account and grants).
#
# A module, called once per environment (deploy/terraform/environments/<env>/main.tf): no provider
# block and no backend here; the environment's root configures both.
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 8.7.0 is the release whose schema deploy/check reads (the cdktn-provider-google 21.1.0
      # manifest); the 7.0 and 8.0 upgrade guides' breaking changes are listed in deploy/README.md.
      # 9.0 is a major release with breaking changes: move on purpose.
      version = ">= 8.7, < 9"
    }
    # Only for google_project_service_identity (kms.tf), which exists in google-beta alone: it
    # creates the Cloud SQL, Pub/Sub and Artifact Registry service agents a customer-managed key
    # must be granted to before the instance, the topics and the repository are made with it.
    google-beta = {
      source  = "hashicorp/google-beta"
      version = ">= 8.7, < 9"
    }
  }
}
