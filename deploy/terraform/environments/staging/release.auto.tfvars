# The staging release: what changes from one release to the next, in one committed file that every
# plan and apply in this directory reads (Terraform loads *.auto.tfvars by itself). Change it here,
# commit, apply; never pass these with -var, -var-file or TF_VAR_: an apply without them would put
# the older value back (the producer on an old image against a newer schema, or its schedule paused
# again). deploy/check refuses a document step that does. Order of a first deploy and of every
# release: deploy/README.md, section 4.

# The producer's image, by digest (deploy/README.md, section 1). EDIT at each release. The
# all-zero digest is the template's placeholder: a plan refuses it until a real one is set here.
producer_image = "europe-west1-docker.pkg.dev/my-project-staging/pubsub-outbox/producer@sha256:0000000000000000000000000000000000000000000000000000000000000000"

# The Cloud SQL Auth Proxy of the producer job's sidecar; the same tag and digest as every proxy
# in deploy/k8s (deploy/check compares them).
cloud_sql_proxy_image = "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.18.2@sha256:fc224915ef435afeb5b2a9421260a0d31986d5c8b7c7f5783c7f5d5885700cd2"

# First deploy: true, the schema does not exist yet. false once the migration has run and the
# dispatcher is rolled out (section 4, step 7).
producer_schedule_paused = true

# First deploy: false, or OutboxDispatcherAbsent pages five minutes after the apply and the
# producer's alerts page on an empty schema. true at step 7, with the schedule (section 4).
alerts_enabled = false
