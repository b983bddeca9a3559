# The images' Docker repository: the dispatcher's and the producer's (deploy/README.md, section 1)
# and the mirrored third-party ones the cluster runs (the bootstrap Job's postgres). The GKE nodes'
# service account reads it, so a private cluster pulls through Private Google Access, with no
# Cloud NAT and no route to Docker Hub.

resource "google_artifact_registry_repository" "images" {
  count = var.create_artifact_registry_repository ? 1 : 0

  repository_id = var.artifact_registry_repository
  location      = var.region
  format        = "DOCKER"
  description   = "pubsub-outbox images (dispatcher, producer) and the mirrored ones its Jobs run."
  # Optional CMEK (var.kms_key_name), taken only at creation; its service agent is granted first
  # (kms.tf).
  kms_key_name = var.kms_key_name

  depends_on = [google_project_service.enabled, google_kms_crypto_key_iam_member.service_agents]
}

locals {
  # The repository's name whether it is created here or exists already, and its Docker host path.
  # (The created one's attribute, so the grant waits for the repository.)
  artifact_registry_repository = coalesce(one(google_artifact_registry_repository.images[*].repository_id), var.artifact_registry_repository)
  artifact_registry_url        = "${var.region}-docker.pkg.dev/${var.project_id}/${local.artifact_registry_repository}"
}

# The kubelet pulls with the nodes' service account (not the pods' Workload Identity).
resource "google_artifact_registry_repository_iam_member" "gke_nodes_read" {
  project    = var.project_id
  location   = var.region
  repository = local.artifact_registry_repository
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${var.gke_node_service_account}"
  depends_on = [google_project_service.enabled]
}
