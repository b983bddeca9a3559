# shellcheck shell=bash
# Sourced by operator/run and bootstrap/run: create a rendered Job, wait for its one pod, print the
# named container's output and exit with that container's exit code. If the command has not run
# after 3 minutes (the proxy cannot connect: Workload Identity, IAM, the network), it prints the
# Job's events and the proxy's log, leaves the Job for the caller to delete and exits 1.
#
#   run_job NAMESPACE RENDERED_YAML CONTAINER
run_job() {
	local namespace=$1 rendered=$2 container=$3 job started code
	job=$(kubectl create -f "$rendered" -o name) || return 1 # job.batch/NAME-xxxxx
	echo "${me:-run}: $job created in $namespace; waiting for it to finish" >&2
	pod_status() {
		kubectl -n "$namespace" get pods -l "job-name=${job#*/}" -o "jsonpath={.items[0].status$1}" 2>/dev/null || true
	}
	started=$SECONDS
	while :; do
		case "$(pod_status .phase)" in
		Succeeded | Failed) break ;;
		Running) ;;
		*)
			# Pending (the proxy not up: IAM, network) or gone (the Job's deadline).
			if [ $((SECONDS - started)) -ge 180 ]; then
				echo "${me:-run}: $job has not run its command after 3 minutes:" >&2
				kubectl -n "$namespace" describe "$job" >&2 || true
				kubectl -n "$namespace" logs "$job" -c cloud-sql-proxy --tail=20 >&2 || true
				echo "${me:-run}: left in place; delete it with: kubectl -n $namespace delete $job" >&2
				return 1
			fi
			;;
		esac
		sleep 2
	done
	kubectl -n "$namespace" logs "$job" -c "$container"
	code=$(pod_status ".containerStatuses[?(@.name==\"$container\")].state.terminated.exitCode")
	return "${code:-1}"
}
