package quota

import (
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
)

// azureBedrockLimits sets p's kind and limits, and the fleet's at 95% of
// their rates, for an Azure or a Bedrock fleet (see llmFleet). Azure:
// 20,000 tokens a second in a bucket of 1 s, the window it checks, and
// 120 requests (6 a minute for each 1,000 tokens a minute) in one of 1 s;
// the fleet's profile derives its buckets from its tokens a minute and a
// window of 0.5 s. Bedrock: 20,000 tokens a second, a second's, output
// 5 times over, and 100 requests; the fleet's bucket holds 12,000. The
// fleets' buckets hold less than the provider's so that grants that
// reach it late on a loaded machine, while its bucket is full, cost no
// refill the fleet counts on: with margins of 2,400 and 5,000 tokens
// (120 and 250 ms of refill) an Azure fleet met 4 429s in one run of the
// root's tests beside other work (a load of 12 on 2 cores), and with
// 1,000 a Bedrock fleet, whose requests reserve over 5,000 tokens each,
// met 3 and 5 beside a busy core.
func azureBedrockLimits(api string, p *llmfake.Server, fleet *llmLimits) {
	switch api {
	case "azure":
		p.Kind = llmfake.Azure
		p.Limits = llmfake.Limits{
			Requests: llmfake.Bucket{Rate: 120, Burst: 120},
			Tokens:   llmfake.Bucket{Rate: 20000, Burst: 20000},
		}
		fleet.Tokens, fleet.Window = Limit{Rate: 19000}, 500*time.Millisecond
	case "bedrock":
		p.Kind = llmfake.Bedrock
		p.Limits = llmfake.Limits{
			Requests:       llmfake.Bucket{Rate: 100, Burst: 100},
			Tokens:         llmfake.Bucket{Rate: 20000, Burst: 20000},
			OutputBurndown: 5,
		}
		fleet.Tokens, fleet.Burndown = Limit{Rate: 19000, Burst: 8000}, 5
	}
}

// azureBedrockPath returns the path an Azure or a Bedrock fleet posts to,
// and its requests' Limit: Azure's profile derives it from the tokens.
func azureBedrockPath(api string, stream bool, fleet llmLimits) (string, Limit) {
	if api == "azure" {
		_, requests := LLMProfiles.Azure(fleet.Tokens.Rate*60, fleet.Window)
		return "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", requests
	}
	if stream {
		return "/model/anthropic.claude-sonnet-4-20250514-v1%3A0/converse-stream", Limit{Rate: 95, Burst: 95}
	}
	return "/model/anthropic.claude-sonnet-4-20250514-v1%3A0/converse", Limit{Rate: 95, Burst: 95}
}

// checkRefusalPauses checks that the 429s of a per-process Azure fleet paused
// its buckets (their retry-after-ms), and those of a Bedrock fleet, a
// ThrottlingException without Retry-After, paused nothing.
func checkRefusalPauses(t *testing.T, r *llmRun) {
	switch {
	case !r.ownLimit || r.refused == 0:
	case r.api == "azure" && r.perReq["pause"] == 0:
		t.Errorf("%s: %d 429s and no pause: their retry-after-ms paused nothing", r.name(), r.refused)
	case r.api == "bedrock" && r.perReq["pause"] > 0:
		t.Errorf("%s: %.2f pauses a request: a ThrottlingException asks for none", r.name(), r.perReq["pause"])
	}
}
